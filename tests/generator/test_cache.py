"""The engine's compile cache: one model path per shape, shared by runs (generator.cache_dir)."""

from __future__ import annotations

import threading

from colo_rl.config import GeneratorConfig, ModelConfig
from colo_rl.generator import VLLMGenerator
from colo_rl.generator.client import shared_model_dir, vllm_cache_root
from colo_rl.models import write_embedded_model


def test_runs_of_one_shape_give_the_engine_one_model_path_and_another_shape_another(tmp_path):
    cache = tmp_path / "cache"
    a = write_embedded_model(ModelConfig(), tmp_path / "run_a" / "embedded_model")
    b = write_embedded_model(ModelConfig(), tmp_path / "run_b" / "embedded_model")
    shared = shared_model_dir(a, cache)
    assert shared_model_dir(b, cache) == shared and shared.parent == cache / "colo_rl_models"
    assert sorted(p.name for p in shared.iterdir()) == sorted(p.name for p in a.iterdir())
    assert all((shared / p.name).read_bytes() == p.read_bytes() for p in a.iterdir())
    other = ModelConfig()
    other.embedded.num_hidden_layers += 1
    c = write_embedded_model(other, tmp_path / "run_c" / "embedded_model")
    assert shared_model_dir(c, cache) != shared
    assert len(list((cache / "colo_rl_models").iterdir())) == 2  # no staging directory left


def test_concurrent_jobs_share_the_copy(tmp_path):
    model = write_embedded_model(ModelConfig(), tmp_path / "m")
    found, errors = [], []

    def job():
        try:
            found.append(shared_model_dir(model, tmp_path / "cache"))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=job) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(found)) == 1
    assert len(list((tmp_path / "cache" / "colo_rl_models").iterdir())) == 1


def test_cache_dir_sets_the_engines_vllm_cache_root(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = VLLMGenerator(GeneratorConfig(), model_dir=tmp_path, dtype="float32", log_dir=tmp_path)
    assert "VLLM_CACHE_ROOT" not in default._env()  # vLLM's own default, which is:
    assert vllm_cache_root(GeneratorConfig()) == tmp_path / "xdg" / "vllm"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "env"))
    assert vllm_cache_root(GeneratorConfig()) == tmp_path / "env"
    cfg = GeneratorConfig(cache_dir=str(tmp_path / "mine"))
    assert vllm_cache_root(cfg) == tmp_path / "mine"
    assert VLLMGenerator(cfg, model_dir=tmp_path, dtype="float32", log_dir=tmp_path)._env()[
        "VLLM_CACHE_ROOT"] == str(tmp_path / "mine")
