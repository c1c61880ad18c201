"""vLLM's model-info cache for a model served by a package (the Transformers backend runs OLMo-2):
without it every engine start inspects the model class in a fresh interpreter (~19 s on the H200
with vLLM 0.26, whose cache lookup misses packages; colo_rl's worker backports the later fix)."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("vllm")


def test_the_transformers_backend_is_inspected_once_per_cache_root(tmp_path, monkeypatch):
    from vllm.model_executor.models import registry

    from colo_rl.generator.worker import cache_package_model_info

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(registry._LazyRegisteredModel, "inspect_model_cls",
                        registry._LazyRegisteredModel.inspect_model_cls)  # undone after the test
    cache_package_model_info()
    cache_package_model_info()  # idempotent: wrapped once
    assert registry._LazyRegisteredModel.inspect_model_cls.colo_rl_package_cache
    inspected = []
    real = registry._run_in_subprocess

    def counting(fn):  # the real subprocess, counted
        inspected.append(fn)
        return real(fn)

    monkeypatch.setattr(registry, "_run_in_subprocess", counting)
    model = registry._LazyRegisteredModel("vllm.model_executor.models.transformers", "TransformersForCausalLM")
    first = model.inspect_model_cls()
    assert len(inspected) == 1
    assert (tmp_path / "modelinfos" / "vllm-model_executor-models-transformers-TransformersForCausalLM.json").exists()
    again = registry._LazyRegisteredModel("vllm.model_executor.models.transformers",
                                          "TransformersForCausalLM").inspect_model_cls()
    assert len(inspected) == 1  # from the cache: no second interpreter
    as_json = lambda info: json.dumps(dataclasses.asdict(info), sort_keys=True)  # noqa: E731 (tuples come back as lists)
    assert as_json(again) == as_json(first) and again.is_text_generation_model


def test_a_cold_inspection_runs_in_a_fork_of_the_worker_not_a_fresh_interpreter(tmp_path, monkeypatch):
    """The first start on a cache root (a fresh machine) inspects the model class in a child: a fork
    of the worker, which has imported vLLM already, instead of vLLM's new interpreter (18 s of the
    H100's cold start). Same answer; a failure in the child raises in the worker; with CUDA
    initialised in the worker (a fork could not use it) vLLM's subprocess stays."""
    import subprocess

    import torch
    from vllm.model_executor.models import registry

    from colo_rl.generator.worker import inspect_models_in_fork

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    real = registry._run_in_subprocess
    expected = real(lambda: registry._ModelInfo.from_model_cls(registry._LazyRegisteredModel(
        "vllm.model_executor.models.transformers", "TransformersForCausalLM").load_model_cls()))
    monkeypatch.setattr(registry, "_run_in_subprocess", real)  # undone after the test
    inspect_models_in_fork()
    inspect_models_in_fork()  # idempotent: wrapped once
    assert registry._run_in_subprocess.colo_rl_fork

    def no_interpreter(*args, **kwargs):
        raise AssertionError(f"a new interpreter was started: {args[0]}")

    monkeypatch.setattr(subprocess, "run", no_interpreter)
    model = registry._LazyRegisteredModel("vllm.model_executor.models.transformers", "TransformersForCausalLM")
    info = model.inspect_model_cls()
    as_json = lambda info: json.dumps(dataclasses.asdict(info), sort_keys=True)  # noqa: E731
    assert as_json(info) == as_json(expected) and info.is_text_generation_model

    def fails():
        raise ValueError("no such model")

    with pytest.raises(RuntimeError, match="exit code 1"):
        registry._run_in_subprocess(fails)

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(AssertionError, match="new interpreter"):
        registry._run_in_subprocess(lambda: 1)
