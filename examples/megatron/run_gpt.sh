#!/bin/bash

# Runs a GPT-2-small-sized model (12 layers, hidden 768, ~124M parameters) on 2 GPUs with
# mock data, without Apex or Transformer Engine: a Megatron-LM launch script to try
# commsched on (see README.md). Run it from a Megatron-LM checkout:
#
#   bash run_gpt.sh                 # stock Megatron-LM
#   commsched patch-launch run_gpt.sh -o run_gpt_commsched.sh
#   COMMSCHED=1 bash run_gpt_commsched.sh
#
# OVERLAP=1 adds the distributed optimizer with overlapped gradient reduce-scatters and
# parameter all-gathers (--use-distributed-optimizer --overlap-grad-reduce
# --overlap-param-gather); OVERLAP=grad overlaps the gradient all-reduces with the backward
# (--overlap-grad-reduce); without either, gradients are all-reduced after the backward.
# NUM_LAYERS, HIDDEN_SIZE, NUM_HEADS set the model (default 12, 768, 12); EXTRA_ARGS is
# appended to pretrain_gpt.py's arguments (a later flag overrides an earlier one).

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-2}
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-29500}
NUM_NODES=1
NODE_RANK=0

TRAIN_ITERS=${TRAIN_ITERS:-50}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-8}
GLOBAL_BATCH_SIZE=$((MICRO_BATCH_SIZE * GPUS_PER_NODE * NUM_NODES))

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers ${NUM_LAYERS:-12}
    --hidden-size ${HIDDEN_SIZE:-768}
    --num-attention-heads ${NUM_HEADS:-12}
    --seq-length 1024
    --max-position-embeddings 1024
    --transformer-impl local
    --no-gradient-accumulation-fusion
    --no-persist-layer-norm
    --no-masked-softmax-fusion
)

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --train-iters $TRAIN_ITERS
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    --clip-grad 1.0
    --bf16
    --lr 6.0e-4
    --lr-decay-style cosine
    --min-lr 6.0e-5
    --lr-warmup-iters 5
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
)

if [ "${OVERLAP:-0}" = "1" ]; then
    MODEL_PARALLEL_ARGS+=(
        --use-distributed-optimizer
        --overlap-grad-reduce
        --overlap-param-gather
    )
elif [ "${OVERLAP:-0}" = "grad" ]; then
    MODEL_PARALLEL_ARGS+=(--overlap-grad-reduce)
fi

DATA_ARGS=(
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 50257
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 1000
    --eval-iters 0
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    ${EXTRA_ARGS:-}
