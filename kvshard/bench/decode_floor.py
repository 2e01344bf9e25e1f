"""`kvshard bench decode-floor`: one decode step at a large batch against its memory-bandwidth floor.

A decode step must read every weight once and the live KV of every request
once; nothing can make it faster than those bytes divided by the machine's
memory bandwidth. The bandwidth is measured here as a large torch tensor copy
(bytes read + bytes written per second, best of a few), the step by running
`batch_size` requests of `context_len` tokens to their decode phase and timing
single engine steps. The ratio step / floor says how far the engine is from
the hardware: 1.0 would be perfect.

Counted per rank (rank 0, in this process): all parameters except the token
embedding table, of which a step reads one row per request; and the KV of
every request's context on this rank (`kv_bytes_per_token_per_rank` times the
context tokens). A MoE model is counted with all its experts (a large batch
routes to nearly all of them). Activations and the new tokens' KV writes are
left out: small at these sizes, and leaving them out only lowers the floor.
Likewise the compute floor leaves out everything but the products (norms,
softmax, the sampler) and counts attention's heads as this rank's share of them.

`--alternate-eager` (one rank, a compiled engine): after the timed steps, `rounds` more blocks of
`steps` steps each with the compiled model step and with the eager one on the same engine, the same
requests and KV, taking turns (compiled first, then eager first, ...), so that a busy machine's load
falls on both alike; each block's median is reported.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

import torch

from kvshard.attention.timing import PHASES
from kvshard.bench.workloads import WorkloadSpec

if TYPE_CHECKING:
    from kvshard.engine.arg_utils import EngineArgs


def copy_bandwidth(num_bytes: int = 2**30, repeats: int = 10, device: str | torch.device = "cpu") -> float:
    """Bytes per second (read + written) of the best of `repeats` copies of a `num_bytes` float32 tensor
    on `device` (a GPU's copies are timed to their end). On a CPU that gives transparent huge pages on
    advice, the copies run on the allocator's pages and between two buffers on huge pages (the pages the
    engine puts its weights and KV cache on: kvshard/host_pages.py), and the faster counts: the floor is
    what the machine's memory can do."""
    from kvshard import host_pages

    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pairs = [lambda: torch.empty(num_bytes // 4, dtype=torch.float32, device=device)]
    if host_pages.huge_pages_here(device):
        pairs.append(lambda: host_pages.huge_page_buffer(num_bytes // 4 * 4).view(torch.float32))
    best = float("inf")
    for make in pairs:  # one pair at a time: the memory of two copies, not four
        source, target = make().fill_(1.0), make()
        target.copy_(source)  # first touch: page faults are not bandwidth
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            target.copy_(source)
            sync()
            best = min(best, time.perf_counter() - start)
        del source, target
    return 2 * (num_bytes // 4 * 4) / best


def matmul_rate(rows: int, dtype: torch.dtype, repeats: int = 10, size: int = 2048,
                device: str | torch.device = "cpu") -> float:
    """Multiply-adds per second of the best of `repeats` products [rows, size] x [size, size] in `dtype` on
    `device` (on a CPU in the dtype its products run in: cpu_product_dtype), on this process's threads."""
    from kvshard.layers.cpu_dtypes import cpu_product_dtype

    device = torch.device(device)
    if device.type == "cpu":
        dtype = cpu_product_dtype(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(rows, size, dtype=dtype, device=device)
    weight = torch.randn(size, size, dtype=dtype, device=device)
    torch.nn.functional.linear(x, weight)  # first call: the library's set-up is not arithmetic
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        sync()
        best = min(best, time.perf_counter() - start)
    return rows * size * size / best


def weight_multiply_adds_per_step(model: torch.nn.Module, batch_size: int) -> int:
    """Multiply-adds of a decode step's products with this rank's weights: each linear layer's weight and the LM
    head's rows once per request; a MoE layer's routed experts in the share a token's top-k picks of all
    experts (its router once per request); the token embedding (a lookup) none."""
    from kvshard.layers.embedding import ParallelLMHead
    from kvshard.layers.linear import LinearBase
    from kvshard.layers.moe import FusedMoE, TopKRouter
    from kvshard.models.deepseek import LatentUpProjection

    total = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            out_features, in_features = module.weight_shape
            total += out_features * in_features
        elif isinstance(module, ParallelLMHead):
            total += module.weight.shape[0] * module.weight.shape[1]
        elif isinstance(module, LatentUpProjection):  # MLA's absorbed decode: W_UK for every query head it
            # computes (the query into the latent), W_UV for the heads whose output it keeps (the latent out)
            total += len(module.q_heads) * module.nope_dim * module.latent_dim
            total += len(module.own_heads) * module.v_dim * module.latent_dim
        elif isinstance(module, TopKRouter):
            total += module.weight.numel()
        else:
            router, experts = getattr(module, "gate", None), getattr(module, "experts", None)
            if isinstance(router, TopKRouter) and isinstance(experts, FusedMoE):
                expert_weights = experts.w13_weight.numel() + experts.w2_weight.numel()
                total += expert_weights * router.routing.top_k // router.weight.shape[0]
    return total * batch_size


def attention_multiply_adds_per_step(hf_config, tensor_parallel_size: int, kv_tokens: int) -> int:
    """Attention's multiply-adds over `kv_tokens` context tokens (all requests') on one rank: per token and query
    head, its key's channels (scores) and its value's (weighted sum); MLA's decode attends to the latent (its
    channels plus the rotary ones for the scores, the latent again for the values). A rank computes 1 /
    tensor_parallel_size of the heads x tokens in every layout: DCP's ranks take all of a group's heads over
    1 / dcp of the tokens."""
    heads = hf_config.num_attention_heads
    if getattr(hf_config, "kv_lora_rank", None):
        key = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
        value = hf_config.kv_lora_rank
    else:
        key = value = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return hf_config.num_hidden_layers * kv_tokens * heads * (key + value) // tensor_parallel_size


def weight_bytes_per_step(model: torch.nn.Module, batch_size: int) -> int:
    from kvshard.layers.embedding import ParallelLMHead

    # an LM head whose weight is the token embedding's (tied) reads all of it: not one row per request
    head_weights = {id(module.weight) for module in model.modules() if isinstance(module, ParallelLMHead)
                    and module.product_weight is None and module.packed_weight is None}
    total = 0
    # linear layers on CPU hold their weight as oneDNN's reordered copy, a buffer (layers/linear.py); an LM
    # head with a float32 copy for its product (layers/embedding.py) reads the copy, not its weight
    copied = {name.rsplit(".", 1)[0] + ".weight" for name, buffer in model.named_buffers()
              if name.endswith((".product_weight", ".packed_weight")) and buffer is not None}
    for name, parameter in [*model.named_parameters(), *model.named_buffers()]:
        if name in copied:
            continue
        row_bytes = parameter.shape[-1] * parameter.element_size()
        if "embed_tokens" in name and id(parameter) not in head_weights:  # a lookup reads one row per request
            total += min(batch_size, parameter.shape[0]) * row_bytes
        else:
            total += parameter.numel() * parameter.element_size()
    return total


def measure_decode_floor(engine_args: EngineArgs, batch_size: int, context_len: int, steps: int,
                         warmup_steps: int = 3, bandwidth_bytes: int = 2**30, alternate_rounds: int = 0) -> dict:
    from kvshard import LLM, SamplingParams

    # The prompts are prefilled a chunk a step, so the first request decodes that many steps before the last one
    # starts: a request's window holds those tokens too, so that every request stays in the batch for every
    # timed step (the window is sized so where none is given). Every request and every token it decodes must
    # also stay in the KV cache: a preempted request leaves the batch.
    config = engine_args.create_engine_config()
    total_steps = steps * (1 + 2 * alternate_rounds)
    prefill_steps = -(-batch_size * context_len // config.scheduler.max_num_batched_tokens) + 1
    window = context_len + prefill_steps + warmup_steps + total_steps + 8
    if engine_args.max_model_len is None:
        engine_args = replace(engine_args, max_model_len=window)
        config = engine_args.create_engine_config()
    needed = batch_size * (window + config.tokens_per_virtual_block)
    if config.kv_capacity_tokens < needed:
        per_token = config.kv_bytes_per_token_per_rank
        raise ValueError(f"the KV cache holds {config.kv_capacity_tokens:,} tokens per rank; {batch_size} requests of "
                         f"{context_len:,} tokens decoding {total_steps} timed steps need about {needed:,}: pass "
                         f"--kv-cache-memory {int(needed * per_token) // 2**20 + 1}MiB or more")
    # the device rank 0 runs on (engine/process_setup.py), measured before any rank starts
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bandwidth = copy_bandwidth(bandwidth_bytes, device=device)
    with LLM(**asdict(engine_args)) as llm:
        engine, config = llm.engine, llm.config
        runner = engine.runner
        if alternate_rounds and (runner.compiled is None or config.parallel.world_size > 1):
            raise ValueError("--alternate-eager compares the compiled and the eager step of one rank: run it with "
                             "-O 3 at tensor parallel size 1, on a CPU")
        spec = WorkloadSpec("random", config.model.hf_config.vocab_size, engine_args.seed,
                            input_len=context_len, output_len=warmup_steps + total_steps + 1)
        requests = spec.requests(batch_size)
        # Chunked prefill gives the requests their first tokens steps apart, so a budget of exactly the timed
        # steps would end the first requests while the timing still ran (a shrinking batch, its steps ever
        # faster): every request may run to the model's length, and what is left is aborted after the timing.
        longest = max(len(request.prompt_token_ids) for request in requests)
        budget = max(warmup_steps + total_steps + 1, config.scheduler.max_model_len - longest)
        params = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True)
        generated: dict[str, int] = {}
        for request in requests:
            request_id = f"floor-{uuid.uuid4().hex[:8]}"
            engine.add_request(request_id, request.prompt_token_ids, params)
            generated[request_id] = 0

        def step(timed: bool = False) -> None:
            before = dict(generated)
            for output in engine.step():
                generated[output.request_id] = len(output.outputs[0].token_ids)
            if timed and any(generated[r] <= before[r] for r in generated):
                raise RuntimeError("a request left the decode batch while timing (finished, or preempted: raise "
                                   "--kv-cache-memory or --max-model-len)")

        while min(generated.values()) == 0:  # prefill: until every request has its first token
            step()
        for _ in range(warmup_steps):
            step()
        times, kv_tokens = [], []
        dcp_before = engine.stats().dcp_timing
        for _ in range(steps):
            kv_tokens.append(sum(context_len + n for n in generated.values()))  # tokens this step attends to
            start = time.perf_counter()
            step(timed=True)
            times.append(time.perf_counter() - start)
        alternation = []  # (compiled?, median step ms) per block
        compiled_step = runner.step_model
        for block in range(2 * alternate_rounds):
            compiled = (block % 2 == 0) == (block // 2 % 2 == 0)  # C E, E C, C E, ...
            runner.step_model = compiled_step if compiled else runner.model
            block_times = []
            for _ in range(steps):
                start = time.perf_counter()
                step(timed=True)
                block_times.append(time.perf_counter() - start)
            alternation.append(("compiled" if compiled else "eager", sorted(block_times)[steps // 2] * 1e3))
        runner.step_model = compiled_step
        dcp_after = engine.stats().dcp_timing  # gathered every KVSHARD_DCP_TIMING_EVERY steps
        dcp = dcp_after.since(dcp_before) if dcp_after is not None and dcp_after is not dcp_before else None
        weights = weight_bytes_per_step(engine.runner.model, batch_size)
        weight_macs = weight_multiply_adds_per_step(engine.runner.model, batch_size)
        # rank 0's threads (this process's, set as the engine started), while every rank waits for a plan
        product_rate = matmul_rate(batch_size, config.model.dtype, device=device)
        hf_config, tp = config.model.hf_config, config.parallel.tensor_parallel_size
        compile_s = engine.runner.compile_seconds  # None: the model step ran eagerly
        layers = decode_path(engine.runner.step_model)
        kv_per_token = config.kv_bytes_per_token_per_rank
        for request_id in generated:
            engine.abort_request(request_id)

    step_s = sorted(times)[len(times) // 2]
    kv_bytes = kv_per_token * sorted(kv_tokens)[len(kv_tokens) // 2]
    floor_s = (weights + kv_bytes) / bandwidth
    attention_macs = attention_multiply_adds_per_step(hf_config, tp, sorted(kv_tokens)[len(kv_tokens) // 2])
    multiply_adds = weight_macs + attention_macs
    compute_floor_s = multiply_adds / product_rate
    return {
        "model": engine_args.model,
        "engine_config": {k: v for k, v in asdict(engine_args).items() if v is not None and k != "model"},
        "threads": torch.get_num_threads(),
        "batch_size": batch_size, "context_len": context_len, "steps": steps,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_per_step": weights, "kv_bytes_per_step": kv_bytes,
        "floor_ms": floor_s * 1e3, "median_step_ms": step_s * 1e3,
        "min_step_ms": min(times) * 1e3, "ratio_to_floor": step_s / floor_s,
        "multiply_adds_per_step": multiply_adds, "product_rate_gmacs": product_rate / 1e9,
        "compute_floor_ms": compute_floor_s * 1e3, "ratio_to_compute_floor": step_s / compute_floor_s,
        "decode_tokens_per_s": batch_size / step_s,
        "compile_s": compile_s,
        "decode_layers": layers,
        "alternation_ms": alternation,
        "dcp_ms_per_step": ({phase: [t * 1e3 for t in dcp.per_step(phase)] for phase in PHASES} | {
            "steps": dcp.steps, "merges": dcp.merges} if dcp is not None else None),
        "dcp_summary": dcp.summary() if dcp is not None else None,
    }


def decode_path(step_model) -> str:
    """How rank 0's decode steps ran their layers (models/decode_program.py): the report's words."""
    from kvshard.models.decode_program import DecodeProgram

    if not isinstance(step_model, DecodeProgram):
        return "the layers' modules"
    if step_model.native is not None:
        return "one call of the kernel extension (decode_layers)"
    return "a flat program of the kernel extension's calls"


def format_decode_floor(result: dict) -> str:
    mib = 2**20
    return "\n".join([
        f"copy bandwidth (read + write): {result['copy_bandwidth_gb_s']:.1f} GB/s",
        f"bytes per decode step per rank: weights {result['weight_bytes_per_step'] / mib:.1f} MiB + "
        f"KV {result['kv_bytes_per_step'] / mib:.1f} MiB "
        f"({result['batch_size']} requests of ~{result['context_len']:,} tokens)",
        f"floor: {result['floor_ms']:.2f} ms per step; measured: {result['median_step_ms']:.2f} ms median "
        f"({result['min_step_ms']:.2f} ms best, {result['threads']} threads) "
        f"-> {result['ratio_to_floor']:.1f}x the floor, {result['decode_tokens_per_s']:.0f} decode tok/s",
        f"compute floor: {result['compute_floor_ms']:.2f} ms per step ({result['multiply_adds_per_step'] / 1e9:.2f} G "
        f"multiply-adds at {result['product_rate_gmacs']:.1f} G/s, a [{result['batch_size']}, 2048] x [2048, 2048] "
        f"product's rate here) -> {result['ratio_to_compute_floor']:.1f}x it; "
        + ("the arithmetic, not the memory, bounds this step here"
           if result["compute_floor_ms"] > result["floor_ms"] else "the memory bounds this step"),
        "model step: " + ("eager" if result.get("compile_s") is None
                          else f"compiled (torch.compile, {result['compile_s']:.1f} s at start-up)")
        + (f"; decode steps' layers: {result['decode_layers']}" if result.get("decode_layers") else ""),
        *([result["dcp_summary"]] if result.get("dcp_summary") else []),
        *(["compiled vs eager, blocks in turn (median ms per step): " + ", ".join(
            f"{name} {ms:.2f}" for name, ms in result["alternation_ms"])] if result.get("alternation_ms") else []),
    ])
