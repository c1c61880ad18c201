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
