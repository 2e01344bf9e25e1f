"""What the engine reports about itself: for logs and /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvshard.attention.timing import DcpTimingReport


@dataclass
class EngineStats:
    """Counters and gauges at one moment."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    # seconds of engine steps (scheduling, the model, sampling, outputs) by kind: steps that computed prompt
    # tokens (decodes may ride along in them), and steps of decodes (and drafts) only
    prefill_step_seconds: float = 0.0
    decode_step_seconds: float = 0.0
    # per DCP rank: tokens of live requests stored there (the engine's own accounting)
    kv_tokens_per_dcp_rank: list[int] = field(default_factory=list)
    # prefix cache: tokens of admitted requests looked up and found; blocks holding a cached prefix (per rank)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_cached: int = 0
    dcp_timing: DcpTimingReport | None = None  # every rank's time in DCP collectives, attention, merge
    # speculative decoding (vLLM's counters): requests' steps that verified drafts, drafts verified,
    # drafts accepted, and accepted drafts by position (index 0: the first draft of a step)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step gives a request on average: its own token plus the accepted drafts."""
        if not self.spec_decode_num_drafts:
            return 0.0
        return 1.0 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
