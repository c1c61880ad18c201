"""An fp32 engine asks Triton for full-fp32 dots (the GPU suite's fp32 log-prob test is the end-to-end
check: with Triton's TF32 default, vLLM's Triton attention put the engine 1e-2 away from the trainer)."""

from __future__ import annotations

import os

import pytest

from colo_rl.generator.worker import exact_fp32_dots


@pytest.mark.parametrize("dtype", ["float32", "torch.float32"])
def test_an_fp32_engine_makes_ieee_the_default(monkeypatch, dtype):
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    exact_fp32_dots(dtype)
    assert os.environ["TRITON_F32_DEFAULT"] == "ieee"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", None])
def test_other_dtypes_leave_triton_alone(monkeypatch, dtype):
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    exact_fp32_dots(dtype)
    assert "TRITON_F32_DEFAULT" not in os.environ


def test_a_users_choice_is_kept(monkeypatch):
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    exact_fp32_dots("float32")
    assert os.environ["TRITON_F32_DEFAULT"] == "tf32"
