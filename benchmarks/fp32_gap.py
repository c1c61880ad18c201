"""Which forward is not fp32? The engine's (vLLM through colo_rl's own Switch and worker) and the
trainer's (Hugging Face, fp32) log-probs of a perturbed fp32 model, each against an fp64 Hugging Face
reference; one engine per variant, a variant being NAME:ENV=VALUE,... (`eager=1`: enforce_eager).

    python benchmarks/fp32_gap.py base: tf32:TRITON_F32_DEFAULT=tf32 eager:eager=1   # on a GPU, ~1 min a variant

Writes $OUT/fp32_gap.json (issue #39: the engine side was TF32 in vLLM's Triton attention).
"""
import copy
import json
import os
import sys
import time
from pathlib import Path
import torch
from colo_rl.config import EmbeddedModelConfig, GeneratorConfig, ModelConfig, SamplingConfig
from colo_rl.generator import VLLMGenerator
from colo_rl.models import load_policy, write_embedded_model
from colo_rl.switch import Switch

SMALL = EmbeddedModelConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=8, vocab_size=64)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [20, 21, 22, 23, 24], [30, 31]]
GREEDY = SamplingConfig(n=1, temperature=0.0, max_tokens=16)
out = Path(os.environ.get("OUT", "/tmp")); work = Path("/tmp/fp32diag"); work.mkdir(exist_ok=True)
mcfg = ModelConfig(dtype="float32", embedded=SMALL)
model_dir = write_embedded_model(mcfg, work / "model")
model = load_policy(mcfg, model_dir, "cuda")
g = torch.Generator().manual_seed(1)
with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * 0.5)
ref64 = copy.deepcopy(model).double()

def lp(m, prompt, completion):
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logits = m(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(completion)].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion, device="cuda").unsqueeze(-1)).squeeze(-1)

print("torch matmul precision (trainer process):", torch.get_float32_matmul_precision(), flush=True)
results = {}
for spec in sys.argv[1:]:
    name, _, envs = spec.partition(":")
    saved = dict(os.environ)
    eager = False
    for kv in filter(None, envs.split(",")):
        k, _, v = kv.partition("=")
        if k == "eager": eager = True
        else: os.environ[k] = v
    t = time.time()
    try:
        gen = VLLMGenerator(GeneratorConfig(weight_sync="cuda_ipc", gpu_memory_utilization=0.3, enforce_eager=eager or None),
                            model_dir=model_dir, dtype="float32", log_dir=work / f"engine_{name}")
        r = Switch(gen, model).generate(PROMPTS, GREEDY)
        eng, tr = [], []
        for prompt, toks, elp in zip(PROMPTS, r.completion_ids, r.logprobs):
            ref = lp(ref64, prompt, toks)
            eng.append((torch.tensor(elp, device="cuda", dtype=torch.float64) - ref).abs())
            tr.append((lp(model, prompt, toks) - ref).abs())
        gen.close()
        eng, tr = torch.cat(eng), torch.cat(tr)
        log = (work / f"engine_{name}" / "engine.log")
        backend = [l.strip()[-160:] for l in log.read_text().splitlines() if "ttention backend" in l or "Using " in l][:6] if log.exists() else []
        results[name] = dict(env=envs, engine_vs_fp64_max=eng.max().item(), engine_vs_fp64_mean=eng.mean().item(),
                             trainer_vs_fp64_max=tr.max().item(), trainer_vs_fp64_mean=tr.mean().item(),
                             seconds=time.time() - t, backend_lines=backend)
    except Exception as e:  # a variant that cannot start is recorded, the others still run
        results[name] = dict(env=envs, error=repr(e)[:500])
    os.environ.clear(); os.environ.update(saved)
    print(name, json.dumps(results[name]), flush=True)
(out / "fp32_gap.json").write_text(json.dumps(results, indent=1))
