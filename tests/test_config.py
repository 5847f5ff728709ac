"""Config: defaults, parsing, and a clear error naming the variable for every bad value."""

import dataclasses
import os
import subprocess
import sys

import pytest

from commsched.config import (ENV_VARS, Config, ConfigError, parse_bytes,
                              warn_data_parallel_only)


def test_defaults_are_off_and_valid():
    config = Config.from_env({})
    assert config == Config()
    assert config.enabled is False


def test_every_field_parsed_from_its_variable():
    config = Config.from_env({
        "COMMSCHED": "1", "COMMSCHED_PARTITION_BYTES": "4MiB",
        "COMMSCHED_CREDIT_BYTES": "inf", "COMMSCHED_POLICY": "FIFO",
        "COMMSCHED_DECOMPOSE": "rs_ag", "COMMSCHED_TIMEOUT_S": "60", "COMMSCHED_VERIFY": "1",
        "COMMSCHED_TELEMETRY_DIR": "/tmp/run", "COMMSCHED_NVTX": "1",
        "COMMSCHED_TELEMETRY_NVML_PERIOD_MS": "0", "COMMSCHED_TELEMETRY_MAX_BYTES": "1GiB",
        "COMMSCHED_GROUP_BYTES": "64MiB", "COMMSCHED_FIRST_GROUP_BYTES": "16M",
        "COMMSCHED_GROUPS_IN_FLIGHT": "3", "COMMSCHED_GRAD_REDUCE_DTYPE": "bfloat16",
        "COMMSCHED_AUTOTUNE": "1"})
    assert config == Config(enabled=True, partition_bytes=4 << 20, credit_bytes=0,
                            policy="fifo", decompose="rs_ag", timeout_s=60, verify=True,
                            group_bytes=64 << 20, first_group_bytes=16 << 20,
                            groups_in_flight=3, grad_reduce_dtype="bfloat16",
                            telemetry_dir="/tmp/run", nvtx=True, telemetry_nvml_period_ms=0,
                            telemetry_max_bytes=1 << 30, autotune=True)


def test_at_most_16_variables_each_with_a_one_line_rule_grouped_by_concern():
    from commsched.config import GROUPS, env_fields
    assert len(ENV_VARS) <= 16
    assert all(ENV_VARS.values()) and all("\n" not in rule for rule in ENV_VARS.values())
    assert [f.metadata["group"] for f in dataclasses.fields(Config)] == sorted(
        (f.metadata["group"] for f in dataclasses.fields(Config)), key=GROUPS.index)
    assert list(env_fields()) == list(ENV_VARS)


@pytest.mark.parametrize("var,field,value", [
    ("COMMSCHED_LOCAL_SIZE", "local_size", 2), ("COMMSCHED_PROFILE_ITERS", "profile_iters", 3),
    ("COMMSCHED_PLAN_FORWARD", "plan_forward", False),
    ("COMMSCHED_SPARSE_EMBEDDING_ROWS", "sparse_embedding_rows", 1000),
    ("COMMSCHED_AUTOTUNE_ITERS", "autotune_iters", 3),
    ("COMMSCHED_TELEMETRY_NVML_PER_LINK", "telemetry_nvml_per_link", False)])
def test_a_setting_that_left_the_environment_stays_a_constructor_argument(var, field, value):
    with pytest.raises(ConfigError, match=f"{var}: no longer a commsched setting: .*; "
                                          "unset it") as err:
        Config.from_env({var: "1"})
    assert field in str(err.value) or "LOCAL_WORLD_SIZE" in str(err.value)
    assert getattr(Config(**{field: value}), field) == value


@pytest.mark.parametrize("text,value", [
    ("4194304", 4194304), ("4MiB", 4 << 20), ("4M", 4 << 20), ("4mb", 4 << 20),
    ("64kb", 64 << 10), ("64K", 64 << 10), ("1 GiB", 1 << 30), ("1G", 1 << 30),
    ("0", 0), ("inf", 0), ("512KiB", 512 << 10)])
def test_parse_bytes(text, value):
    assert parse_bytes(text, "X") == value


BAD = [
    ("COMMSCHED", "yes"), ("COMMSCHED", ""), ("COMMSCHED", "2"),
    ("COMMSCHED_PARTITION_BYTES", "-1"), ("COMMSCHED_PARTITION_BYTES", "4XB"),
    ("COMMSCHED_PARTITION_BYTES", ""), ("COMMSCHED_PARTITION_BYTES", "2TiB"),
    ("COMMSCHED_CREDIT_BYTES", "1.5MiB"), ("COMMSCHED_CREDIT_BYTES", "lots"),
    ("COMMSCHED_POLICY", "lifo"), ("COMMSCHED_POLICY", ""),
    ("COMMSCHED_DECOMPOSE", "tree"), ("COMMSCHED_TIMEOUT_S", "-1"),
    ("COMMSCHED_TIMEOUT_S", "x"), ("COMMSCHED_TELEMETRY_DIR", "  "),
    ("COMMSCHED_NVTX", "true"), ("COMMSCHED_TELEMETRY_NVML_PERIOD_MS", "-3"),
    ("COMMSCHED_VERIFY", "2"), ("COMMSCHED_TELEMETRY_MAX_BYTES", "big"),
    # "inf" would read as 0, which for layer groups means the smallest (one per module)
    ("COMMSCHED_GROUP_BYTES", "inf"), ("COMMSCHED_GROUP_BYTES", "-1"),
    ("COMMSCHED_FIRST_GROUP_BYTES", "inf"), ("COMMSCHED_FIRST_GROUP_BYTES", "2TiB"),
    ("COMMSCHED_GROUPS_IN_FLIGHT", "-1"), ("COMMSCHED_GROUPS_IN_FLIGHT", "one"),
    ("COMMSCHED_GROUPS_IN_FLIGHT", "1.5"), ("COMMSCHED_GROUPS_IN_FLIGHT", "inf"),
    ("COMMSCHED_GRAD_REDUCE_DTYPE", "bf16"), ("COMMSCHED_GRAD_REDUCE_DTYPE", ""),
    ("COMMSCHED_GRAD_REDUCE_DTYPE", "float32"),
]


def test_grad_reduce_dtype_is_the_gradients_own_unless_set():
    assert Config().grad_reduce_dtype is None
    assert Config.from_env({"COMMSCHED_GRAD_REDUCE_DTYPE": "BFloat16"}).grad_reduce_dtype \
        == "bfloat16"
    assert Config.from_env({"COMMSCHED_GRAD_REDUCE_DTYPE": "float16"}).grad_reduce_dtype \
        == "float16"
    with pytest.raises(ConfigError, match="grad_reduce_dtype='int8'"):
        Config(grad_reduce_dtype="int8")


@pytest.mark.parametrize("value", ["inf", "-3", "4XB", ""])
def test_a_byte_count_whose_zero_means_off_offers_no_inf(value):
    with pytest.raises(ConfigError) as err:
        Config.from_env({"COMMSCHED_FIRST_GROUP_BYTES": value})
    assert str(err.value) == (f"COMMSCHED_FIRST_GROUP_BYTES={value!r}: expected a byte count "
                              "such as 100MiB (0: off)")
    assert Config.from_env({"COMMSCHED_FIRST_GROUP_BYTES": "16MiB"}).first_group_bytes == 16 << 20


def test_group_bytes_zero_is_one_group_per_module():
    assert Config.from_env({"COMMSCHED_GROUP_BYTES": "0"}).group_bytes == 0


def test_no_window_of_layer_groups_unless_set():
    assert Config().groups_in_flight == 0
    assert Config.from_env({"COMMSCHED_GROUPS_IN_FLIGHT": "2"}).groups_in_flight == 2
    with pytest.raises(ConfigError, match="groups_in_flight"):
        Config(groups_in_flight=-1)


@pytest.mark.parametrize("var,value", BAD)
def test_bad_value_names_the_variable(var, value):
    with pytest.raises(ConfigError) as err:
        Config.from_env({var: value})
    assert var in str(err.value)


def test_unknown_variable_suggests_the_known_one():
    with pytest.raises(ConfigError, match="did you mean COMMSCHED_CREDIT_BYTES"):
        Config.from_env({"COMMSCHED_CREDIT_BYTE": "1"})


def test_readme_settings_table_is_the_one_generated_from_the_field_descriptions():
    """One description per setting: the attribute docstring. The README's table is what
    `commsched env --markdown` prints; a new or changed setting means regenerating it."""
    from commsched.config import field_docs, settings_table
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    begin = readme.index("<!-- settings table: generated by `commsched env --markdown` -->\n")
    end = readme.index("<!-- end of settings table -->")
    table = readme[readme.index("\n", begin) + 1:end]
    assert table == settings_table(), "regenerate: commsched env --markdown"
    docs = field_docs()
    for f in dataclasses.fields(Config):
        assert docs.get(f.name), f"{f.name} has no description (attribute docstring)"
        assert (f"`{f.metadata['env']}`" in table) == bool(f.metadata["env"]), f.name
    assert all(ENV_VARS.values())


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="credit_bytes"):
        Config(credit_bytes=-5)
    with pytest.raises(ConfigError, match="policy"):
        Config(policy="random")


@pytest.mark.parametrize("var,value", [BAD[0], BAD[3], BAD[9], BAD[10], BAD[12]])
def test_launcher_exits_nonzero_naming_the_variable(var, value, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('the script ran')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    env[var] = value
    proc = subprocess.run([sys.executable, "-m", "commsched.run", str(script)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert var in proc.stderr
    assert "the script ran" not in proc.stdout
    assert "Traceback" not in proc.stderr


def test_every_commsched_error_derives_from_one_base():
    """``except commsched.CommschedError`` catches whatever commsched raised, and each error
    keeps the standard base that says what kind it is."""
    import commsched
    from commsched.megatron_patches.launch_script import LaunchPatchError
    from commsched.megatron_patches.versions import UnsupportedMegatronVersion
    from commsched.safety import AgreementError
    from commsched.sim.model import SimError
    from commsched.telemetry.errors import TelemetryError
    from commsched import errors
    from commsched.floor import FloorError
    kinds = {commsched.ConfigError: ValueError, commsched.SchedulerError: RuntimeError,
             AgreementError: RuntimeError, SimError: ValueError, LaunchPatchError: ValueError,
             UnsupportedMegatronVersion: RuntimeError, TelemetryError: Exception,
             errors.DataParallelError: RuntimeError, errors.UnsupportedError: TypeError,
             errors.NotSupportedError: NotImplementedError,
             errors.UnavailableError: RuntimeError, FloorError: RuntimeError}
    for error, kind in kinds.items():
        assert issubclass(error, commsched.CommschedError), error
        assert issubclass(error, kind), error
    with pytest.raises(commsched.CommschedError, match="COMMSCHED_POLICY"):
        commsched.Config.from_env({"COMMSCHED_POLICY": "lifo"})


def test_the_adapters_are_attributes_of_the_package():
    """After ``import commsched`` the README's ``commsched.hooks.register(...)`` works."""
    code = ("import commsched, sys; assert 'commsched.hooks' not in sys.modules; "
            "print(commsched.hooks.register.__name__, commsched.megatron_patches.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["register", "commsched.megatron_patches"]


def test_the_core_loads_no_telemetry_store_nvml_simulator_or_tuner():
    """``import commsched`` / ``commsched.scheduler`` / ``commsched.hooks`` load what
    observes the scheduler (store, NVML sampler) and the tuner only when a setting asks."""
    heavy = ("commsched.telemetry.store", "commsched.telemetry.recorder",
             "commsched.telemetry.nvml", "commsched.telemetry.sampler", "commsched.sim",
             "commsched.autotune", "commsched.calibrate", "commsched.data_parallel", "sqlite3")
    code = ("import sys, commsched, commsched.scheduler, commsched.hooks; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_unset_policy_is_each_adapter_s_default():
    assert Config().policy is None
    assert Config.from_env({}).policy is None
    assert Config.from_env({"COMMSCHED_POLICY": "fifo"}).policy == "fifo"
    assert Config().with_policy("fifo").policy == "fifo"
    assert Config(policy="priority").with_policy("fifo").policy == "priority"
    from commsched import Scheduler
    scheduler = Scheduler(Config())
    try:
        assert scheduler.config.policy == "priority"       # a Scheduler of its own plans
    finally:
        scheduler.close()


def test_data_parallel_only_settings_are_named_where_set():
    assert Config().data_parallel_only() == []
    config = Config(grad_reduce_dtype="bfloat16", group_bytes=1 << 20, plan_forward=False,
                    partition_bytes=1 << 20)
    assert config.data_parallel_only() == [
        "COMMSCHED_GROUP_BYTES", "COMMSCHED_GRAD_REDUCE_DTYPE", "plan_forward"]
    with pytest.warns(UserWarning) as caught:
        warn_data_parallel_only(Config(sparse_embedding_rows=5), "DDP hook")
    assert [str(w.message) for w in caught] == [
        "commsched DDP hook: sparse_embedding_rows is read by the data-parallel "
        "mode (commsched.wrap) only and ignored here"]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_data_parallel_only(Config(partition_bytes=4 << 20), "DDP hook")


def test_a_removed_variable_is_an_error_that_says_what_replaced_it():
    with pytest.raises(ConfigError, match="COMMSCHED_DISPATCH: no longer a commsched setting: "
                                          "collectives are always issued by the thread"):
        Config.from_env({"COMMSCHED_DISPATCH": "thread"})


def test_settings_served_by_an_extension_need_it_in_a_bare_scheduler(world1):
    from commsched import Scheduler
    from commsched.adapter import build_scheduler
    for name in ("autotune", "nvtx"):
        with pytest.raises(ConfigError, match=f"{name}=True needs the extension"):
            Scheduler(Config(**{name: True}))
        scheduler, recorder = build_scheduler(Config(**{name: True}))
        assert recorder is None and name in {
            provided for make in scheduler.extensions for provided in make.provides}
        scheduler.close()
