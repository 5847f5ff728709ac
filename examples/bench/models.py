"""Benchmark models written in plain PyTorch (no torchvision): a GPT-like decoder, VGG-16
and ResNet-50; and a Llama-architecture decoder from Hugging Face ``transformers``
(``llama_lm``, where that library is installed).

Each architecture takes size knobs so that the same code builds the full-size model used
on GPUs and a tiny one for the CPU smoke test. At full size the parameter counts are the
standard ones: GPT 24x1024 with vocab 50257 and an untied LM head has 405,762,048
parameters, VGG-16 138,357,544 and ResNet-50 25,557,032 (1000 classes).

Example::

    model = GPT(GPTConfig(layers=2, hidden=128, heads=4, seq=64, vocab=4096))
    logits = model(torch.randint(0, 4096, (2, 64)))   # (2, 64, 4096)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig", "GPT", "VGG", "VGG16_LAYOUT", "vgg16", "ResNet", "Bottleneck", "resnet50",
    "count_parameters", "LibraryLM", "LLAMA_SHAPE", "LLAMA_QUICK_SHAPE", "llama_lm",
    "GPT2_SHAPES", "gpt2_lm",
    "lm_batch", "lm_loss",
]


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (elements) of ``model``; works on the meta device too."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------
# GPT-like decoder
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder. The defaults are the benchmark's full-size model (~405M)."""

    layers: int = 24
    hidden: int = 1024
    heads: int = 16
    seq: int = 512
    vocab: int = 50257
    mlp_ratio: int = 4


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=2)
        # (batch, seq, hidden) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class DecoderBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc_out = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-like decoder: token + learned position embeddings, ``layers`` pre-LN blocks, a
    final LayerNorm and an untied LM head. ``forward(tokens)`` returns logits of shape
    ``(batch, seq, vocab)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.hidden)
        self.pos_emb = nn.Embedding(config.seq, config.hidden)
        self.blocks = nn.ModuleList(
            DecoderBlock(config.hidden, config.heads, config.mlp_ratio)
            for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.apply(_init_gpt_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_gpt_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


# ---------------------------------------------------------------------------------------
# VGG-16
# ---------------------------------------------------------------------------------------

# Output channels of each 3x3 convolution; "M" is a 2x2 max-pool (configuration "D").
VGG16_LAYOUT: Sequence[Union[int, str]] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    """VGG without batch norm: conv3x3+ReLU stacks, an adaptive average pool to
    ``pool x pool``, and a three-layer classifier with dropout.

    ``width`` scales every convolution's channels (1.0 = the published network)."""

    def __init__(self, layout: Sequence[Union[int, str]] = VGG16_LAYOUT, *,
                 width: float = 1.0, pool: int = 7, classifier_hidden: int = 4096,
                 num_classes: int = 1000) -> None:
        super().__init__()
        layers: List[nn.Module] = []
        channels = 3
        for item in layout:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                out = max(1, int(round(int(item) * width)))
                layers += [nn.Conv2d(channels, out, kernel_size=3, padding=1),
                           nn.ReLU(inplace=True)]
                channels = out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        self.classifier = nn.Sequential(
            nn.Linear(channels * pool * pool, classifier_hidden), nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(classifier_hidden, classifier_hidden), nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(classifier_hidden, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(images))
        return self.classifier(torch.flatten(x, 1))


def vgg16(**kwargs) -> VGG:
    """VGG-16 (configuration D); keyword arguments as for :class:`VGG`."""
    return VGG(VGG16_LAYOUT, **kwargs)


# ---------------------------------------------------------------------------------------
# ResNet-50
# ---------------------------------------------------------------------------------------

class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, each with batch norm; a
    projection shortcut when the shape changes."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        out = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        y = F.relu(self.bn2(self.conv2(y)), inplace=True)
        y = self.bn3(self.conv3(y))
        return F.relu(y + self.shortcut(x), inplace=True)


class ResNet(nn.Module):
    """ResNet with bottleneck blocks. ``blocks`` per stage, e.g. (3, 4, 6, 3) for
    ResNet-50; ``width`` scales every stage's channels (1.0 = the published network)."""

    def __init__(self, blocks: Sequence[int] = (3, 4, 6, 3), *, width: float = 1.0,
                 num_classes: int = 1000) -> None:
        super().__init__()
        base = max(1, int(round(64 * width)))
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(base),
            nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        stages: List[nn.Module] = []
        in_channels = base
        for index, count in enumerate(blocks):
            channels = base * (2 ** index)
            for block in range(count):
                stride = 2 if (block == 0 and index > 0) else 1
                stages.append(Bottleneck(in_channels, channels, stride))
                in_channels = channels * Bottleneck.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(images))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet50(**kwargs) -> ResNet:
    """ResNet-50 (3, 4, 6, 3 bottleneck blocks); keyword arguments as for :class:`ResNet`."""
    return ResNet((3, 4, 6, 3), **kwargs)


# ---------------------------------------------------------------------------------------
# Library models (Hugging Face transformers)
# ---------------------------------------------------------------------------------------

class LibraryLM(nn.Module):
    """A causal language model of Hugging Face ``transformers`` returning its logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits


# A Llama-architecture decoder: 8 layers of 2048, 16 heads, MLP 5632, vocab 32000, untied
# embeddings; sequence 2048, micro-batch 4 (the shapes and the batch, in one place, for
# every script that trains it).
LLAMA_SHAPE = dict(num_hidden_layers=8, hidden_size=2048, intermediate_size=5632,
                   num_attention_heads=16, vocab_size=32000, seq=2048, micro_batch=4)
LLAMA_QUICK_SHAPE = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=352,
                         num_attention_heads=4, vocab_size=4096, seq=64, micro_batch=2)


def llama_lm(shape: dict = LLAMA_SHAPE) -> LibraryLM:
    """``transformers.LlamaForCausalLM`` of ``shape`` (random initialisation from its
    config, untied embeddings, no dropout). Raises ImportError without ``transformers``.

    Example::

        with torch.device("cuda"):
            model = llama_lm()
    """
    import transformers

    layers = {k: v for k, v in shape.items() if k not in ("seq", "micro_batch")}
    config = transformers.LlamaConfig(**layers, max_position_embeddings=shape["seq"],
                                      tie_word_embeddings=False, attention_dropout=0.0)
    return LibraryLM(transformers.LlamaForCausalLM(config))


def lm_batch(vocab: int, micro_batch: int, seq: int, device: torch.device,
             generator: torch.Generator):
    """A random language-model batch: (tokens, next-token targets), each (micro_batch, seq),
    drawn in that order from ``generator``."""
    size = (micro_batch, seq)
    tokens = torch.randint(0, vocab, size, device=device, generator=generator)
    targets = torch.randint(0, vocab, size, device=device, generator=generator)
    return tokens, targets


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every token position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# GPT-2 small and medium (tied embeddings), sequence 1024, micro-batch 8.
GPT2_SHAPES = {
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq=1024, micro_batch=8),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, seq=1024,
                        micro_batch=8),
}


def gpt2_lm(shape: dict) -> LibraryLM:
    """``transformers.GPT2LMHeadModel`` of ``shape`` (one of ``GPT2_SHAPES``; random
    initialisation from its config, no dropout). Raises ImportError without
    ``transformers``."""
    import transformers

    layers = {k: v for k, v in shape.items() if k not in ("seq", "micro_batch")}
    config = transformers.GPT2Config(**layers, n_positions=shape["seq"], resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    return LibraryLM(transformers.GPT2LMHeadModel(config))
