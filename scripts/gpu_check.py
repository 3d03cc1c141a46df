"""One-GPU check of the GPU code paths, and a decode-latency profile for the simulator.

Needs torch, transformers and pydantic (Ray and vLLM are used when importable, never required),
and nothing from a model hub: every model is randomly initialised from a Qwen2.5-shaped config.

Sections (each reports ok/failed and its numbers; the exit status is 1 if any failed):

1. **trainer**: one FSDP2 (``fully_shard`` per decoder layer, bf16 compute, fp32 reduce) GRPO-style
   policy-gradient step on a Qwen2.5-1.5B-shaped model, world size 1 (NCCL on GPU, gloo on CPU):
   step time, tokens/s, peak memory, and that the weights moved.
2. **generation**: the vLLM engine backend (``streamrl.sgs.engines.vllm_engine``, device cuda) on
   that model when vLLM is importable, else transformers ``generate``: tokens/s.
3. **streamrl**: the product's own parts, no Ray: ``FSDPRank`` (bf16, NCCL) takes one GRPO step;
   its gathered state dict becomes one ``FlatWeights`` buffer that a ``TransformersCBEngine``
   instance on the same device loads, checked equal to the trainer's, then generates with it
   (the weight path trainer -> instance, timed leg by leg).
4. **decode profile**: per-token decode latency vs batch size (1..512) of a Qwen2.5-7B-shaped bf16
   model, from transformers ``generate`` with a KV cache (difference of an N-token and a 1-token
   run, which removes prefill, as ``streamrl profile`` does), saved in the format ``streamrl
   profile`` writes (``scheduling.latency``'s ``points`` plus extras), next to the simulator's
   roofline prediction for this GPU when it is in the catalog.

``--tiny`` swaps every shape for a tiny one so the whole script runs on a CPU in seconds (the
test suite does this); ``--device cpu`` forces the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

# Qwen2.5 shapes (config.json of the released checkpoints; weights are random here).
SHAPES = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=256, tie_word_embeddings=True),
}
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def build_model(shape: str, dtype, device):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, rope_theta=1e6)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: a 7B model never exists in fp32
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model, cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_trainer(shape: str, device: str, seq_len: int, batch: int) -> dict[str, Any]:
    """One FSDP2 bf16 policy-gradient step, world size 1."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    backend = "nccl" if device == "cuda" else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        model, cfg = build_model(shape, torch.float32, device)  # fp32 master weights
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g).to(device)
        adv = torch.randn(batch, generator=g).to(device)
        before = next(model.parameters()).detach().full_tensor().float().clone()
        times = []
        for step in range(2):  # the first step pays allocation and kernel selection: report the second
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            logits = model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -(logp.mean(-1) * adv).mean()  # on-policy GRPO surrogate: ratio 1, gradient of A * log p
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        after = next(model.parameters()).detach().full_tensor().float()
        moved = float((after - before).abs().max())
        ok = bool(torch.isfinite(loss).item() and torch.isfinite(norm).item() and moved > 0)
        out = {"ok": ok, "shape": shape, "params": sum(p.numel() for p in model.parameters()),
               "batch": batch, "seq_len": seq_len, "step_s": times[-1], "first_step_s": times[0],
               "tokens_per_s": batch * seq_len / times[-1], "loss": loss.item(), "grad_norm": norm.item(),
               "max_weight_change": moved}
        if device == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del model, opt
        return out
    finally:
        dist.destroy_process_group()


def check_generation(shape: str, device: str, batch: int, new_tokens: int) -> dict[str, Any]:
    """vLLM engine backend if importable, else transformers generate."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is not None and device == "cuda":
        return _generation_vllm(shape, batch, new_tokens)
    model, cfg = build_model(shape, torch.bfloat16 if device == "cuda" else torch.float32, device)
    ids = torch.randint(0, cfg.vocab_size, (batch, 16), generator=torch.Generator().manual_seed(1)).to(device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)
    _sync(device)
    dt = time.perf_counter() - t0
    n = (out.shape[1] - ids.shape[1]) * batch
    del model
    return {"ok": n == batch * new_tokens, "engine": "transformers.generate", "batch": batch,
            "new_tokens": new_tokens, "seconds": dt, "tokens_per_s": n / dt}


def _generation_vllm(shape: str, batch: int, new_tokens: int) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from streamrl.sgs.engines.vllm_engine import VLLMEngine
    from streamrl.types import GenRequest

    model, _ = build_model(shape, torch.bfloat16, "cpu")
    state = model.state_dict()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        model.save_pretrained(d)
        t0 = time.perf_counter()
        engine = VLLMEngine(d, device="cuda", dtype="bfloat16", multiprocessing=False, enforce_eager=False,
                            max_requests_per_batch=max(batch, 8), num_blocks=4096, page_size=16,
                            max_batch_tokens=8192, eos_token_id=None, seed=0)
        start_s = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            for i in range(batch):
                engine.add_request(GenRequest(f"r{i}", "p", i, tuple(range(1, 17)), new_tokens))
            done = []
            while len(done) < batch:
                done += engine.get_completions(timeout=300)
            dt = time.perf_counter() - t0
            tw = time.perf_counter()
            engine.update_weights(state, version=1)  # the shm reload path, timed (same weights)
            update_s = time.perf_counter() - tw
        finally:
            engine.shutdown()
    n = sum(len(c.output_ids) for c in done)
    return {"ok": n == batch * new_tokens, "engine": "vllm", "batch": batch, "new_tokens": new_tokens,
            "seconds": dt, "tokens_per_s": n / dt, "engine_start_s": start_s, "weight_update_s": update_s}


def check_streamrl_path(shape: str, device: str, batch: int, prompt_len: int, resp_len: int,
                        new_tokens: int) -> dict[str, Any]:
    """streamrl's own parts end to end on one device: ``FSDPRank`` (bf16 compute, NCCL on GPU)
    takes one GRPO step; its full state dict is gathered, flattened into one ``FlatWeights``
    buffer and loaded into a ``TransformersCBEngine`` instance, which then generates. The
    weights the instance holds are checked against the trainer's, tensor by tensor."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from streamrl.models.logprobs import token_logprobs
    from streamrl.models.tiny import build_tokenizer, load_policy
    from streamrl.sgs.engines.transformers_cb import TransformersCBEngine
    from streamrl.trainer.fsdp import FSDPRank
    from streamrl.trainer.trainer import Prepared, set_group_advantages
    from streamrl.types import GenRequest
    from streamrl.weights.flat import flatten, unflatten

    out: dict[str, Any] = {"shape": shape, "batch": batch, "prompt_len": prompt_len, "resp_len": resp_len}
    with tempfile.TemporaryDirectory() as d:
        model, cfg = build_model(shape, torch.bfloat16, "cpu")  # loaded back in fp32 (master weights)
        model.save_pretrained(d)
        build_tokenizer(["0123456789 abc"]).save_pretrained(d)
        del model
        from streamrl.config import config_from_dict

        tree = {"policy": {"path": d}, "trainer": {"micro_batch_tokens": 8 * (prompt_len + resp_len)}}
        rank = FSDPRank(0, 1, config_from_dict(tree), d, "bfloat16" if device == "cuda" else "float32", threads=max(1, os.cpu_count() or 1))
        out["backend"] = rank.setup("127.0.0.1", _free_port(), "nccl" if device == "cuda" else "gloo")
        try:
            g = torch.Generator().manual_seed(3)
            ids = torch.randint(1, cfg.vocab_size, (batch, prompt_len + resp_len), generator=g)
            old = []
            with torch.no_grad():  # on-policy old log-probs: forwards of the sharded policy, 8 rows each
                for chunk in ids.split(8):
                    x = chunk.to(rank._device)
                    logp = token_logprobs(rank.model(input_ids=x).logits[:, :-1], x[:, 1:], temperature=1.0)
                    old.append(logp[:, prompt_len - 1:].float().cpu())
            old = torch.cat(old)
            items = [Prepared(input_ids=ids[i].tolist(), resp_start=prompt_len, old_logprobs=old[i].tolist(),
                              reward=float(torch.rand(1, generator=g)), version=0, prompt_id=f"p{i // 8}")
                     for i in range(batch)]
            set_group_advantages([items[i:i + 8] for i in range(0, batch, 8)])
            name = "model.layers.0.mlp.down_proj.weight"
            before = rank.policy_state()[name].clone()
            _sync(device)
            t0 = time.perf_counter()
            metrics = rank.train_step(items)
            _sync(device)
            out["train_step_s"] = time.perf_counter() - t0
            out["train_tokens_per_s"] = batch * (prompt_len + resp_len) / out["train_step_s"]
            out["grad_norm"] = metrics["train/grad_norm"]
            if device == "cuda":
                out["train_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            t0 = time.perf_counter()
            state = rank.policy_state()  # full state dict on CPU (an all-gather at world size > 1)
            out["gather_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            fw = flatten(state, version=1)
            out["flatten_s"], out["weight_bytes"] = time.perf_counter() - t0, fw.nbytes
            trained = state[name]
        finally:
            rank.close()
        del rank  # the trainer's GPU memory goes before the instance takes its own
        if device == "cuda":
            torch.cuda.empty_cache()
        engine_model, tok = load_policy(d, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        engine_model.to(device).eval()
        engine = TransformersCBEngine(engine_model, attention="dense" if device == "cuda" else "varlen",
                                      eos_token_id=None, pad_token_id=tok.pad_token_id, max_requests_per_batch=batch,
                                      max_batch_tokens=max(1024, 8 * prompt_len),
                                      num_blocks=batch * ((prompt_len + new_tokens) // 32 + 2),
                                      page_size=32, num_threads=max(1, os.cpu_count() or 1), seed=0)
        try:
            t0 = time.perf_counter()
            engine.update_weights(unflatten(fw), version=1)
            out["load_s"] = time.perf_counter() - t0
            out["weight_gb_per_s"] = fw.nbytes / 1e9 / (out["gather_s"] + out["flatten_s"] + out["load_s"])
            held = engine.model.state_dict()[name].detach()
            # the instance's copy is the trainer's fp32 master cast to the instance's dtype, exactly
            out["max_abs_diff_vs_trainer"] = float((held.float().cpu() - trained.to(held.dtype).float()).abs().max())
            out["max_weight_change"] = float((trained.float() - before.float()).abs().max())
            prompts = ids[:, :prompt_len]
            t0 = time.perf_counter()
            for i in range(batch):
                engine.add_request(GenRequest(f"r{i}", f"p{i}", 0, tuple(prompts[i].tolist()), new_tokens))
            done = []
            while len(done) < batch:
                done += engine.get_completions(timeout=300)
            dt = time.perf_counter() - t0
            n = sum(len(c.output_ids) for c in done)
            out.update(gen_tokens=n, gen_s=dt, tokens_per_s=n / dt,
                       versions=sorted({c.version_start for c in done}))
        finally:
            engine.shutdown()
    out["ok"] = bool(out["max_weight_change"] > 0 and out["max_abs_diff_vs_trainer"] == 0
                     and out["gen_tokens"] == batch * new_tokens and out["versions"] == [1])
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def profile_decode(shape: str, device: str, batch_sizes, new_tokens: int, prompt_len: int) -> dict[str, Any]:
    """PTL(BS): per-token decode latency, the difference of a ``new_tokens`` and a 1-token run."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, cfg = build_model(shape, dtype, device)
    model.eval()
    g = torch.Generator().manual_seed(2)

    def run(ids, n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t0

    def kernel_ms(ids, steps: int = 8) -> float:
        """GPU kernel time of one decode step (CUDA profiler sum over ``steps`` steps): what a
        step costs with the host's launch gaps removed, as CUDA graphs would."""
        from torch.profiler import ProfilerActivity, profile

        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(2):
                out = model(input_ids=tok, past_key_values=past, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            _sync(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    out = model(input_ids=tok, past_key_values=past, use_cache=True)
                    tok = out.logits[:, -1:].argmax(-1)
                _sync(device)
        us = sum(float(getattr(e, "self_device_time_total", 0.0)) for e in prof.key_averages())
        return us / 1000 / steps

    points = []
    for b in batch_sizes:
        ids = torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=g).to(device)
        run(ids[:1], 2)  # warm-up
        one, full = run(ids, 1), run(ids, new_tokens)
        step = max(full - one, 1e-9) / (new_tokens - 1)
        point = {"batch_size": b, "ms_per_token": 1000 * step, "tokens_per_s": b / step}
        if device == "cuda":
            try:
                point["kernel_ms_per_token"] = kernel_ms(ids)
            except Exception as exc:  # the wall-clock profile stands without it
                point["kernel_error"] = repr(exc)
        points.append(point)
        kern = f", kernels {point['kernel_ms_per_token']:7.2f} ms" if "kernel_ms_per_token" in point else ""
        print(f"  decode bs={b:4d}: {1000 * step:8.2f} ms/token, {b / step:10.0f} tokens/s{kern}", flush=True)
    return {"ok": all(p["ms_per_token"] > 0 for p in points), "points": points, "vocab": cfg.vocab_size}


def roofline_points(gpu_name: str, shape: str, batch_sizes, context: float) -> dict[str, list] | None:
    """The simulator's prediction for this GPU (if catalogued) and shape, eager and with graphs."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from streamrl.lab.sim.cost import RooflineDecode
        from streamrl.lab.sim.hardware import get_gpu
        from streamrl.lab.sim.models import get_model
    except Exception as exc:  # the simulator needs only the standard library; report why it is absent
        return {"error": repr(exc)}
    key = next((k for k in ("H200", "H100", "H800", "H20", "A100") if k in gpu_name.upper()), None)
    if key is None or shape not in ("qwen2.5-7b",):
        return None
    try:
        gpu, model = get_gpu(key), get_model(shape)
    except (KeyError, ValueError) as exc:
        return {"error": repr(exc)}
    out = {}
    for eager in (False, True):
        r = RooflineDecode(gpu, model, eager=eager)
        out["eager" if eager else "graphs"] = [1000 * r.step_s(b, b * context) for b in batch_sizes]
    out["gpu"] = key
    return out


def section(name: str, fn: Callable[[], dict[str, Any]], results: dict[str, Any]) -> None:
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        res = fn()
    except Exception as exc:  # every section runs; a failure is reported with its traceback and counted
        traceback.print_exc()
        res = {"ok": False, "error": repr(exc)}
    res["wall_s"] = time.perf_counter() - t0
    results[name] = res
    print(f"   {name}: {'ok' if res.get('ok') else 'FAILED'} ({res['wall_s']:.1f}s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes everywhere (a CPU smoke run)")
    ap.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps per profile point")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--out", default=None, help="profile JSON (default profiles/gpu-<gpu>-qwen2.5-7b-shape.json)")
    ap.add_argument("--summary", default=None, help="also write every section's numbers here (JSON)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: trainer,generation,streamrl,decode")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    train_shape, decode_shape = ("tiny", "tiny") if args.tiny else ("qwen2.5-1.5b", "qwen2.5-7b")
    skip = {s for s in args.skip.split(",") if s}
    print(f"gpu_check: device={device} ({gpu}), torch {torch.__version__}, transformers {transformers.__version__}")
    results: dict[str, Any] = {}
    if "trainer" not in skip:
        section("trainer", lambda: check_trainer(train_shape, device, seq_len=64 if args.tiny else 1024,
                                                 batch=2 if args.tiny else 8), results)
    if "generation" not in skip:
        section("generation", lambda: check_generation(train_shape, device, batch=4 if args.tiny else 64,
                                                       new_tokens=8 if args.tiny else 128), results)
    if "streamrl" not in skip:
        section("streamrl", lambda: check_streamrl_path(
            train_shape, device, batch=8 if args.tiny else 32, prompt_len=8 if args.tiny else 256,
            resp_len=8 if args.tiny else 768, new_tokens=8 if args.tiny else 256), results)
    profile = None
    if "decode" not in skip:
        section("decode", lambda: profile_decode(decode_shape, device, batch_sizes, args.new_tokens,
                                                 args.prompt_len), results)
        dec = results["decode"]
        if dec.get("ok"):
            context = args.prompt_len + args.new_tokens / 2
            profile = {"engine": "transformers.generate", "model": f"{decode_shape}-shape-random", "device": device,
                       "gpu": gpu, "dtype": "bfloat16" if device == "cuda" else "float32", "points": dec["points"],
                       "threads": torch.get_num_threads(), "prompt_len_mean": args.prompt_len,
                       "new_tokens": args.new_tokens, "shape": SHAPES[decode_shape],
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "roofline_ms_per_token": roofline_points(gpu, decode_shape, batch_sizes, context)}
            name = "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-") or device
            out = Path(args.out or f"profiles/gpu-{name}-{decode_shape}-shape.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(profile, indent=1))
            dec["profile"] = str(out)
    print_summary(results, profile)
    if args.summary:
        Path(args.summary).write_text(json.dumps(results, indent=1, default=str))
    return 0 if all(r.get("ok") for r in results.values()) else 1


def print_summary(results: dict[str, Any], profile: dict[str, Any] | None) -> None:
    print("\nsummary")
    print(f"  {'section':<12} {'status':<8} numbers")
    for name, r in results.items():
        keys = [k for k in ("engine", "backend", "params", "step_s", "train_step_s", "train_tokens_per_s",
                            "tokens_per_s", "peak_mem_gib", "train_peak_mem_gib", "engine_start_s", "weight_update_s",
                            "weight_bytes", "gather_s", "flatten_s", "load_s", "weight_gb_per_s",
                            "max_abs_diff_vs_trainer", "profile", "error") if k in r]
        nums = ", ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys)
        print(f"  {name:<12} {'ok' if r.get('ok') else 'FAILED':<8} {nums}")
    if profile:
        roof = profile.get("roofline_ms_per_token") or {}
        print(f"\n  decode PTL(BS), {profile['model']} on {profile['gpu']} ({profile['dtype']})")
        print(f"  {'batch':>6} {'ms/token':>10} {'kernels ms':>10} {'tokens/s':>10}"
              + ("  sim graphs / eager" if "graphs" in roof else ""))
        for i, p in enumerate(profile["points"]):
            extra = f"  {roof['graphs'][i]:8.2f} / {roof['eager'][i]:.2f}" if "graphs" in roof else ""
            kern = f"{p['kernel_ms_per_token']:>10.2f}" if "kernel_ms_per_token" in p else f"{'-':>10}"
            print(f"  {p['batch_size']:>6} {p['ms_per_token']:>10.2f} {kern} {p['tokens_per_s']:>10.0f}{extra}")


if __name__ == "__main__":
    sys.exit(main())
