"""The runtime section: the persistent compilation cache and the profiler trace of chosen steps."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from etils import epath
from helpers import fake_gcs
from helpers.tiny_config import tiny_config, tiny_config_dict

from jrope.errors import ConfigError
from jrope.train import profiler
from jrope.train.config import RuntimeConfig, TrainConfig
from jrope.train.trainer import train_and_evaluate


def test_the_runtime_section_defaults_to_off_and_checks_its_steps():
    assert tiny_config().runtime == RuntimeConfig("", 0, 0)
    assert not tiny_config().runtime.profiles
    with pytest.raises(ConfigError, match=r"runtime\.profile_from_step .* must be >= 0"):
        tiny_config(**{"runtime.profile_from_step": -1})


def test_a_config_without_the_runtime_section_still_loads():
    config = tiny_config_dict().to_dict()
    del config["runtime"]
    assert TrainConfig.from_config_dict(config).runtime == RuntimeConfig()


@pytest.mark.slow
def test_training_traces_the_configured_steps_into_tensorboard(tmp_path):
    cfg = tiny_config(
        **{"mesh.data": -1, "runtime.profile_from_step": 1, "runtime.profile_to_step": 2}
    )
    train_and_evaluate(cfg, str(tmp_path))
    traces = list((tmp_path / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_a_trace_for_a_bucket_is_copied_there_and_nothing_stays_local(monkeypatch, tmp_path):
    fake_gcs.install(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(profiler.tempfile, "tempdir", str(tmp_path))  # staging: here, then gone
    trace = profiler.StepTrace("gs://bucket/run", RuntimeConfig("", 3, 4))
    state = jnp.ones(4)
    for step in range(3, 5):
        trace.before_step(step)
        state = jax.jit(lambda x: x * 2)(state)
        trace.after_step(step, state)
    profile = epath.Path("gs://bucket/run/tensorboard/plugins/profile")
    assert [path.name for path in profile.glob("*/*") if path.name.endswith(".xplane.pb")]
    assert fake_gcs.local_entries(tmp_path) == []


@pytest.mark.slow
def test_the_compilation_cache_stores_the_compiled_programs(tmp_path):
    cache = tmp_path / "cache"
    program = textwrap.dedent(
        f"""
        import jax
        from jrope.train import compilation_cache
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        compilation_cache.enable({str(cache)!r})
        jax.jit(lambda x: x * 2 + 1)(jax.numpy.ones(3)).block_until_ready()
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", program], check=True, env=env, cwd=os.getcwd())
    assert any(cache.iterdir())
