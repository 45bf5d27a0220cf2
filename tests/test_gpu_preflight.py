"""bench/gpu_preflight.py, which scripts/device_check.sh runs on the GPU before measuring: each
kernel with a fallback, run once (interpreted here), turned off where it fails."""

from __future__ import annotations

import jax.numpy as jnp

from bench import gpu_preflight
from kinetic.kernels import pallas_attention, pallas_delta


def exports(capsys) -> tuple[list[str], str]:
    """What main prints for the shell to run, and its log."""
    assert gpu_preflight.main() == 0
    out = capsys.readouterr()
    return out.out.split(), out.err


def test_every_kernel_passes_where_it_runs(capsys, monkeypatch):
    for _, _, var, _ in gpu_preflight.CHECKS:
        monkeypatch.delenv(var, raising=False)
    assert exports(capsys)[0] == []


def test_a_kernel_that_fails_or_is_wrong_is_turned_off(capsys, monkeypatch):
    for _, _, var, _ in gpu_preflight.CHECKS:
        monkeypatch.delenv(var, raising=False)
    real = pallas_attention._split_attention
    monkeypatch.setattr(pallas_attention, "_split_attention",   # off by a little
                        lambda *a: real(*a) * jnp.float32(1.001))

    def broken(*args, **kwargs):
        raise RuntimeError("Triton could not compile it")
    monkeypatch.setattr(pallas_delta, "delta_rule", broken)
    out, err = exports(capsys)
    assert out == ["export", "KINETIC_GPU_ATTENTION=whole", "export", "KINETIC_GPU_DELTA=xla"]
    assert "the attention's lanes failed here" in err and "off by" in err
    assert "the delta rule's kernel failed here" in err and "Triton could not compile it" in err
    assert "the norm's kernel failed" not in err


def test_a_kernel_already_off_is_not_run(capsys, monkeypatch):
    monkeypatch.setenv("KINETIC_GPU_DELTA", "xla")
    monkeypatch.setattr(pallas_delta, "delta_rule", None)   # would fail if called
    assert exports(capsys)[0] == []
