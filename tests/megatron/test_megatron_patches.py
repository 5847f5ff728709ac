"""commsched.megatron_patches: the version gate, apply/remove, apply_on_import, and which
configurations keep megatron's own collectives. In-process, no collectives run here (the
multi-process comparisons with stock megatron-core are in test_megatron_equivalence.py).
"""

import importlib
import inspect
import sys
import warnings

import pytest

pgb = pytest.importorskip("megatron.core.distributed.param_and_grad_buffer",
                          reason="megatron-core is not installed (make test installs it)")

import torch  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402

import commsched.megatron_patches as mp  # noqa: E402
from commsched import CommschedWarning, Config  # noqa: E402
from commsched.megatron_patches import versions  # noqa: E402
from commsched.megatron_patches.bucket_group import (  # noqa: E402
    GRAD_SYNC, PARAM_GATHER, PATCHED_METHODS, GroupState)
from commsched.megatron_patches.install import TARGET  # noqa: E402

CLS = pgb._ParamAndGradBucketGroup


def _methods(cls=CLS):
    return {name: cls.__dict__[name] for name in PATCHED_METHODS}


def _same_functions(a, b):
    return all(a[name] is b[name] for name in PATCHED_METHODS)


@pytest.fixture(autouse=True)
def _unpatched():
    before = _methods()
    yield
    mp.remove()
    assert _same_functions(_methods(), before)


# ---- version gate ----------------------------------------------------------------------------
def test_unsupported_version_is_refused_and_nothing_is_patched(monkeypatch):
    monkeypatch.setattr(versions, "megatron_version", lambda: "0.17.0")
    before = _methods()
    with pytest.raises(mp.UnsupportedMegatronVersion) as info:
        mp.apply(Config())
    assert "megatron-core 0.17.0 is not supported" in str(info.value)
    assert "0.16.x, 0.19.x" in str(info.value)
    assert _same_functions(_methods(), before)
    assert not mp.is_applied()


def test_data_parallel_only_settings_warn_and_the_patches_apply():
    with pytest.warns(UserWarning, match=r"commsched Megatron patches: "
                      r"COMMSCHED_GROUPS_IN_FLIGHT is read by the data-parallel mode"):
        mp.apply(Config(groups_in_flight=3))
    assert mp.is_applied()


def test_supported_series_accept_patch_levels_and_local_versions():
    assert versions.check_supported(CLS, "0.16.0").series == "0.16"
    assert versions.check_supported(CLS, "0.16.1+f8837c0").series == "0.16"


def test_a_changed_signature_is_refused_and_nothing_is_patched(monkeypatch):
    monkeypatch.setattr(CLS, "finish_param_sync", lambda self, skip=False, extra=None: None)
    before = _methods()
    with pytest.raises(mp.UnsupportedMegatronVersion, match=r"finish_param_sync\(self, skip"):
        mp.apply(Config())
    assert _same_functions(_methods(), before)
    assert not mp.is_applied()


def test_a_changed_body_under_the_same_signature_is_refused_naming_the_method(monkeypatch):
    """0.19 changed start_grad_sync's body, not its signature: the body is pinned too."""
    original = CLS.__dict__["start_grad_sync"]

    def start_grad_sync(self, force_all_reduce=False):
        return original(self, force_all_reduce)     # same signature, another body

    monkeypatch.setattr(CLS, "start_grad_sync", start_grad_sync)
    before = _methods()
    with pytest.raises(mp.UnsupportedMegatronVersion,
                       match=r"body of start_grad_sync is not that of megatron-core 0\.16"):
        mp.apply(Config())
    assert _same_functions(_methods(), before)
    assert not mp.is_applied()


def test_the_source_digest_ignores_comments_docstrings_and_wrapping_only():
    plain = "def f(x):\n    if x:\n        y(1, 2)\n    z()\n"
    noisy = ('def f(x):\n    """Doc."""\n    # a comment\n    if x:  # another\n'
             '        y(1,\n          2)\n\n    z()\n')
    moved = "def f(x):\n    if x:\n        y(1, 2)\n        z()\n"
    assert versions.source_hash(plain) == versions.source_hash(noisy)
    assert versions.source_hash(plain) != versions.source_hash(moved)


# f-strings: one token up to Python 3.11, split into parts from 3.12 on (PEP 701).
FSTRINGS = ('def f(self, i):\n'
            '    raise ValueError(f"bucket #{i} of {self.name!r:>{8}} "\n'
            '                     f"{self.ddp_config.use_distributed_optimizer=}"\n'
            '                     f\'\'\'{f"{i:02d}"} spans\n  lines\'\'\', x=f"")\n')
# Computed by this function on Python 3.11.7, 3.12.1 and 3.13.0.
FSTRINGS_DIGEST = "168e7faa539467c3"


def test_the_source_digest_of_f_strings_is_the_same_on_every_python():
    assert versions.source_hash(FSTRINGS) == FSTRINGS_DIGEST
    unwrapped = FSTRINGS.replace('"\n                     f', '" f')
    assert versions.source_hash(unwrapped) == FSTRINGS_DIGEST
    assert versions.source_hash(FSTRINGS.replace("#{i}", "#{i+1}")) != FSTRINGS_DIGEST


def test_the_installed_release_matches_its_pinned_sources():
    series = versions.check_supported(CLS)
    for name in versions.REPLACED:
        digest = versions.source_hash(inspect.getsource(CLS.__dict__[name]))
        assert digest in series.sources[name], (name, digest)


def test_supported_series_are_declared_as_data():
    assert [s.series for s in mp.SUPPORTED] == ["0.16", "0.19"]
    for series in mp.SUPPORTED:
        assert set(PATCHED_METHODS) <= set(series.signatures)
        assert set(series.sources) == set(versions.REPLACED) and all(series.sources.values())


# ---- apply / remove --------------------------------------------------------------------------
def test_apply_replaces_the_methods_on_the_class_keeping_their_signatures():
    before = _methods()
    mp.apply(Config())
    after = _methods()
    for name in PATCHED_METHODS:
        assert after[name] is not before[name]
        assert inspect.signature(after[name]) == inspect.signature(before[name])
    assert mp.is_applied()


@pytest.mark.parametrize("policy, expected", [(None, "fifo"), ("priority", "priority"),
                                               ("fifo", "fifo")])
def test_the_bucket_groups_go_in_submission_order_unless_a_policy_is_set(policy, expected):
    """Unset, the policy is fifo for Megatron (a plan measured slower there); a set one,
    from the environment or the caller's Config, is kept."""
    mp.apply(Config.from_env({} if policy is None else {"COMMSCHED_POLICY": policy}))
    runtime = mp.current_runtime()
    assert runtime.config.policy == expected
    scheduler = runtime._scheduler(torch.device("cpu"))
    try:
        assert scheduler.config.policy == expected
    finally:
        runtime.close()


def test_apply_twice_is_a_no_op():
    mp.apply(Config())
    first, runtime = _methods(), mp.current_runtime()
    mp.apply(Config(partition_bytes=1 << 10))
    assert _same_functions(_methods(), first)
    assert mp.current_runtime() is runtime


def test_remove_restores_the_original_function_objects():
    before = _methods()
    mp.apply(Config())
    mp.remove()
    assert _same_functions(_methods(), before)
    assert not mp.is_applied() and mp.current_runtime() is None
    mp.remove()                       # nothing applied: a no-op


# ---- apply_on_import -------------------------------------------------------------------------
@pytest.fixture
def fresh_import():
    """Lets a test import TARGET anew (a second copy of the module), then puts the real one
    back so that the rest of the session sees the original module and class."""
    parent = sys.modules[TARGET.rpartition(".")[0]]
    saved = sys.modules.pop(TARGET)
    yield lambda: importlib.import_module(TARGET)
    mp.remove()
    sys.modules[TARGET] = saved
    setattr(parent, TARGET.rpartition(".")[2], saved)


def test_apply_on_import_patches_right_after_megatron_imports_the_module(fresh_import):
    mp.apply_on_import(Config())
    assert not mp.is_applied()
    module = fresh_import()
    assert mp.is_applied()
    replaced = module._ParamAndGradBucketGroup.__dict__["start_grad_sync"]
    assert replaced.__module__ == "commsched.megatron_patches.bucket_group"
    assert not any(type(f).__name__ == "_PatchAfterImport" for f in sys.meta_path)


def test_apply_on_import_of_an_unsupported_version_fails_that_import(fresh_import,
                                                                     monkeypatch):
    monkeypatch.setattr(versions, "megatron_version", lambda: "0.15.3")
    mp.apply_on_import(Config())
    with pytest.raises(mp.UnsupportedMegatronVersion, match="0.15.3"):
        fresh_import()
    assert not mp.is_applied()


def test_apply_on_import_applies_at_once_when_already_imported():
    mp.apply_on_import(Config())
    assert mp.is_applied()


# ---- what keeps megatron's own collectives -----------------------------------------------------
class _Group:
    """Stands in for a process group: bucket groups only ask for their rank."""

    def rank(self):
        return 0

    def size(self):
        return 1


def _bucket_group(**ddp_kwargs):
    param = torch.nn.Parameter(torch.zeros(4))
    bucket = pgb._ParamAndGradBucket(
        params=[param], param_data=torch.zeros(4), grad_data=torch.zeros(4), offset=0,
        numel_unpadded=4, gradient_scaling_factor=1.0, bucket_id=0)
    return CLS([bucket], DistributedDataParallelConfig(**ddp_kwargs), _Group(), 1)


@pytest.mark.parametrize("ddp_kwargs, grad, param", [
    (dict(use_distributed_optimizer=True), None, None),
    (dict(), None, "without the distributed optimizer"),
    (dict(use_distributed_optimizer=True, num_distributed_optimizer_instances=2),
     "num_distributed_optimizer_instances", "num_distributed_optimizer_instances"),
    (dict(use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True),
     "reduce_scatter_with_fp32_accumulation", None),
])
def test_unsupported_configurations_keep_megatrons_own_methods(monkeypatch, ddp_kwargs, grad,
                                                               param):
    # Constructing with fp32 accumulation rebinds a megatron module global: keep it local.
    monkeypatch.setattr(pgb, "dist_reduce_scatter_func", pgb.dist_reduce_scatter_func)
    mp.apply(Config())
    bucket_group = _bucket_group(**ddp_kwargs)
    runtime = mp.current_runtime()
    for phase, expected in ((GRAD_SYNC, grad), (PARAM_GATHER, param)):
        reason = runtime.unsupported_reason(bucket_group, phase)
        if expected is None:
            assert reason is None
        else:
            assert expected in reason


def test_quantized_parameters_keep_megatrons_all_gather():
    mp.apply(Config())
    runtime = mp.current_runtime()
    runtime.is_quantized = lambda param: True
    bucket_group = _bucket_group(use_distributed_optimizer=True)
    assert runtime.unsupported_reason(bucket_group, GRAD_SYNC) is None
    assert "FP8/FP4" in runtime.unsupported_reason(bucket_group, PARAM_GATHER)


def test_bucket_groups_built_before_apply_are_left_alone_with_one_warning():
    bucket_group = _bucket_group(use_distributed_optimizer=True)
    mp.apply(Config())
    runtime = mp.current_runtime()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert runtime.member(bucket_group, GRAD_SYNC) is None
        assert runtime.member(bucket_group, GRAD_SYNC) is None
    assert [w.category for w in caught] == [CommschedWarning]
    assert "constructed before commsched.megatron_patches.apply()" in str(caught[0].message)


def test_apply_and_fallbacks_by_design_are_one_notice_each_on_stderr(capsys):
    mp.apply(Config())
    assert capsys.readouterr().err == (
        f"commsched: megatron-core {versions.megatron_version()} bucket groups patched\n")
    runtime = mp.current_runtime()
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a notice, not a warning
        for _ in range(2):
            runtime._log_fallback(PARAM_GATHER, "a reason by design", by_design=True)
    assert capsys.readouterr().err == (
        "commsched: megatron-core's parameter all-gather runs as megatron's own method "
        "(not scheduled) for a reason by design\n")


# ---- priorities ------------------------------------------------------------------------------
class _FakeBucketGroup:
    def __init__(self, grad_data):
        self.buckets = [type("Bucket", (), {"grad_data": grad_data})()]


def test_layer_positions_put_first_layers_of_first_model_chunk_first():
    state = GroupState(group=None, closing_phase=GRAD_SYNC)
    reasons = {GRAD_SYNC: None, PARAM_GATHER: None}
    chunk0, chunk1 = torch.zeros(30), torch.zeros(20)     # two DDP model chunks' buffers
    groups = [_FakeBucketGroup(chunk0[0:10]), _FakeBucketGroup(chunk0[10:20]),
              _FakeBucketGroup(chunk0[20:30]), _FakeBucketGroup(chunk1[0:10]),
              _FakeBucketGroup(chunk1[10:20])]
    members = [state.add(g, reasons) for g in groups]
    # Buckets are built from the last layer backwards: the last bucket of a buffer holds
    # its chunk's first layers.
    assert [state.position(m) for m in members] == [2, 1, 0, 4, 3]
    assert state.size() == 5 and state.closing_count() == 5
