"""A synthetic two-rank run with known timings, bytes and NVLink counters.

Ten iterations per rank; iteration k starts at b_k (b_0 = T0, the run start) and ends with a
step marker. Four 1 MiB all-reduce chunks (2 ranks) per iteration:

  kind        duration  first submit  chunks (ms after b)          flush   NVLink tx/link
  normal      100 ms    10            20-30 30-40 40-50 50-60        50      2048 / 2048 KiB
  compute (5) 150 ms    10            70-80 80-90 90-100 100-110    100      2048 / 2048
  library (7) 150 ms    10            20-42.5 ... 87.5-110 (22.5)    50      2048 / 2048
  hardware(9) 150 ms    10            as library                     50      4096 /    0

NVLink samples: at T0 (zero), 1 us after every step marker, and a mid-iteration one at b+55
with the bytes of the iteration's communication done by then (its chunks move their bytes
evenly while they run). Two active links of 26562 MB/s. ``nvlink=False``: the
same run with the counters never moving (traffic through host memory).
"""

from commsched.telemetry.nvml import GpuInfo, LinkInfo
from commsched.telemetry.sampler import CounterSample, HealthSample, NvmlStatus
from commsched.telemetry.writer import StepMarker

from .helpers import MS, T0, chunk, iteration, write_run

MIB = 1 << 20
KINDS = {5: "compute", 7: "library", 9: "hardware"}
N_ITERS = 10
SPEED_MBPS = 26562


def duration_ms(k):
    return 150 if k in KINDS else 100


def begin_ns(k):
    return T0 + sum(duration_ms(j) for j in range(k)) * MS


def chunk_spans_ms(k):
    kind = KINDS.get(k, "normal")
    if kind == "compute":
        return [(70, 80), (80, 90), (90, 100), (100, 110)]
    if kind in ("library", "hardware"):
        return [(20 + 22.5 * i, 20 + 22.5 * (i + 1)) for i in range(4)]
    return [(20, 30), (30, 40), (40, 50), (50, 60)]


def flush_ms(k):
    return 100 if KINDS.get(k) == "compute" else 50


def done_by(k, t_ms):
    """The share of iteration k's communication time over by t_ms after its start."""
    spans = chunk_spans_ms(k)
    return sum(min(max(t_ms - s, 0), e - s) for s, e in spans) / sum(e - s for s, e in spans)


def link_tx_kib(k):
    return (4096, 0) if KINDS.get(k) == "hardware" else (2048, 2048)


def messages(rank, nvlink=True):
    links = [LinkInfo(l, 1, 6, SPEED_MBPS, "switch", None) for l in range(2)]
    msgs = [NvmlStatus("ok", "2 active links", "580.00", GpuInfo(rank, "Fake", f"GPU-{rank}",
                                                                 f"0000:1{rank}:00.0"), links),
            HealthSample(T0, {l: (1, SPEED_MBPS, 0, 0, 0, 0) for l in range(2)})]
    cum = [0, 0]

    def sample(t, add):
        for l in range(2):
            cum[l] += add[l]
        per = {l: (cum[l], cum[l], None, None) for l in range(2)}
        per[-1] = (sum(cum), sum(cum), None, None)
        return CounterSample(t, 1000, per)

    msgs.append(sample(T0, (0, 0)))
    for k in range(N_ITERS):
        b = begin_ns(k)
        for i, (s, e) in enumerate(chunk_spans_ms(k)):
            msgs.append(chunk(iteration=k, key="bucket0", index=i, num_chunks=4, nbytes=MIB,
                              start=b + int(s * MS), end=b + int(e * MS), submit=b + 10 * MS,
                              priority=i))
        msgs.append(iteration(iteration=k, first_submit=b + 10 * MS, flush=b + flush_ms(k) * MS,
                              requests=1, chunks=4, nbytes=4 * MIB))
        tx = link_tx_kib(k) if nvlink else (0, 0)
        half = [int(x * done_by(k, 55)) for x in tx]
        msgs.append(sample(b + 55 * MS, half))
        t_step = b + duration_ms(k) * MS
        msgs.append(StepMarker(k, t_step))
        msgs.append(sample(t_step + 1000, [x - h for x, h in zip(tx, half)]))
    msgs.append(HealthSample(begin_ns(N_ITERS) + MS,
                             {l: (1, SPEED_MBPS, 0, 0, 0, 0) for l in range(2)}))
    return msgs


def build(run_dir, nvlink=True):
    for rank in (0, 1):
        write_run(str(run_dir), rank, messages(rank, nvlink), host=f"node{rank}")
    return str(run_dir)
