"""lm-evaluation-harness model `moep_ds`: scores and generates with a moep_ds model directory or run.

# B batch, T tokens, V vocabulary

    lm = MoepLM(pretrained="runs/x")                                  # newest complete checkpoint of a run
    simple_evaluate(model=lm, tasks=[...], task_manager=...)
    python -m moep_ds.cli.lm_eval --model moep_ds --model_args pretrained=DIR --batch_size 16 ...

model_args: pretrained, overrides (';'-separated a.b=v), batch_size, device, max_length (capped at the model's
max_seq_len), dtype (float32 | bfloat16 | float16), expert_parallel (true | false); any other key is an error.

Requests are tokenized as lm-eval's TemplateLM does (an empty context is the end-of-text token), sorted by
length (longest first) and batched with right padding: causal blocks never look at the padding, so a score
does not depend on the batch it was computed in, as long as routing is causal at evaluation (expert choice
with `eval_mode: threshold`). The routers' eval modes are reported in `get_model_info()` (lm-eval copies
them into the results' `config`).

Inputs longer than the model's window (max_length L tokens):
  context too long        left-truncated: the continuation is conditioned on the last tokens that fit.
  continuation > L tokens scored in disjoint chunks of L tokens from its start (the last chunk may be shorter),
                          the windows rolling log-likelihood uses: each chunk is predicted from the text before
                          it (context + earlier continuation), left-truncated so the input fits L. The
                          log-likelihood is the sum over chunks; greedy means greedy in every chunk.
"""
from __future__ import annotations

import logging
from typing import Any

import lm_eval.models  # noqa: F401 - registers lm-eval's own models first (its registry loads them only if empty)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from tqdm import tqdm

from moep_ds.errors import SharedUserError, UserError
from moep_ds.evaluation.generate import DTYPES, decode_steps, eval_mode, place_model
from moep_ds.evaluation.partitioned import load_eval_model, model_device, split_over_ranks
from moep_ds.models.eval_modes import routing_eval_modes, summarize_routing_modes

log = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256
# what `--model_args` may set (the other keywords, model and tokenizer, are Python objects)
MODEL_ARGS = ("pretrained", "overrides", "batch_size", "device", "max_length", "dtype", "expert_parallel")
# what lm-eval passes to every model besides batch_size and device: max_batch_size (for --batch_size auto, which
# this model does not do) and trust_remote_code (with --trust_remote_code; loading a moep_ds model runs no code)
LM_EVAL_ARGS = ("max_batch_size", "trust_remote_code")

Request = tuple[tuple[str, str] | None, list[int], list[int]]  # (strings, context ids, continuation ids)


def batch_by_length(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices sorted longest first (ties by index, so the order is deterministic), cut into batches."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def right_pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)


def continuation_logprobs(
    logits_BTV: torch.Tensor, rows: list[list[int]], continuations: list[list[int]]
) -> list[tuple[float, bool]]:
    """Sum of log p(continuation token) and whether every continuation token is the argmax, per row.

    Row b's input is `rows[b]` (its last len(continuations[b]) positions predict the continuation)."""
    logp_BTV = F.log_softmax(logits_BTV.float(), dim=-1)
    out = []
    for b, (row, cont) in enumerate(zip(rows, continuations)):
        n, end = len(cont), len(row)
        logp_NV = logp_BTV[b, end - n:end]
        cont_N = torch.tensor(cont, device=logp_NV.device)
        greedy = bool((logp_NV.argmax(-1) == cont_N).all())
        out.append((float(logp_NV.gather(-1, cont_N[:, None]).sum()), greedy))
    return out


def continuation_windows(context: list[int], continuation: list[int], max_length: int
                         ) -> list[tuple[list[int], list[int]]]:
    """(context, chunk) windows that score `continuation` after `context` with inputs of at most max_length.

    The continuation is cut into chunks of max_length tokens from its start; each chunk's context is the text
    before it, cut on the left to the max_length + 1 - len(chunk) tokens that fit beside it. For a
    continuation that fits this is the one window (context tail, continuation); for a document after the
    end-of-text token it is lm-eval's rolling windows (`get_rolling_token_windows` with context_len=1)."""
    assert context, "an empty context is the end-of-text token"
    full, start = context + continuation, len(context)
    windows = []
    for begin in range(start, len(full), max_length):
        end = min(begin + max_length, len(full))
        windows.append((full[max(0, end - 1 - max_length):begin], full[begin:end]))
    return windows


class MoepLM(TemplateLM):
    """lm-eval `LM` over a moep_ds CausalLM (loaded from `pretrained`, or given as `model` + `tokenizer`).

    Under a launcher (WORLD_SIZE > 1) `pretrained` is loaded split over the ranks (evaluation/partitioned.py:
    ZeRO-3, or with `expert_parallel` its experts sharded); a split `model` is evaluated as it is, in its own
    precision and on its rank's device. Rank r of N then scores batches r, r + N, ... of the requests, every
    rank runs as many forward passes, and the scores are gathered onto every rank; generation decodes with
    rank 0's tokens on every rank (`decode_steps`). lm-eval sees one model (rank 0 of 1, its convention for a
    model split over ranks) and reports on rank 0."""

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        overrides: list[str] | str | None = None,
        batch_size: int | str | None = 16,
        device: str | None = None,
        max_length: int | None = None,
        dtype: str = "float32",
        expert_parallel: bool | str = False,
        ranks: tuple[int, int] | None = None,
        **lm_eval_args: Any,
    ):
        super().__init__()
        check_model_args(lm_eval_args)
        check_dtype(dtype)  # before loading: a bad value would only fail once the model is moved
        check_max_length(max_length)
        self.meta: dict[str, Any] = {}
        self.engine = None  # a partitioned model's DeepSpeed engine (its hooks gather the parameters)
        if model is None:
            if pretrained is None:
                raise SharedUserError("moep_ds model needs pretrained=<model or run directory>")
            if isinstance(overrides, str):
                overrides = overrides.split(";")  # model_args are comma-separated; overrides use ';'
            ep = as_bool("expert_parallel", expert_parallel)  # model_args are strings
            model, _, tokenizer, self.meta, self.engine = load_eval_model(pretrained, overrides, dtype, ep)
        if tokenizer is None:
            raise UserError(f"{pretrained or 'the model'} has no tokenizer (tokenizer.json); lm-eval needs one")
        # `ranks` (r, N): the model being trained, scored as it is (its device and training precision), rank r of N
        # scoring its share of the batches
        self._device = model_device(model) if ranks is not None else place_model(model, device, dtype)
        self.model = model.eval()
        if ranks is None:
            ranks = (dist.get_rank(), dist.get_world_size()) if split_over_ranks(model) else (0, 1)
        self.ranks = ranks
        self.tokenizer = tokenizer
        if not str(batch_size or "").isdigit():
            log.warning("batch_size %r is not a number: using 16 (scores do not depend on it)", batch_size)
        self.batch_size = int(batch_size) if str(batch_size or "").isdigit() else 16
        self._max_length = min(max_length or model.cfg.max_seq_len, model.cfg.max_seq_len)
        self.routing_eval_mode = routing_eval_modes(self.model)

    # ---- what lm-eval asks of a TemplateLM
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.meta.get("model_dir", "moep_ds")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def get_model_info(self) -> dict[str, Any]:
        return {
            "moep_model_dir": self.meta.get("model_dir"),
            "moep_step": self.meta.get("step"),
            "routing_eval_mode": summarize_routing_modes(self.routing_eval_mode),
            "routing_eval_modes": self.routing_eval_mode,
        }

    # ---- scoring
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False, **kwargs: Any):
        """Each request is split by `continuation_windows` into windows that fit max_length; their scores add."""
        windows, owner = [], []
        for n, (_, ctx, cont) in enumerate(requests):
            for window in continuation_windows(ctx, cont, self.max_length):
                windows.append(window)
                owner.append(n)
        scores = self._score_windows(windows, disable_tqdm)
        results = [(0.0, True)] * len(requests)
        for n, (logp, greedy) in zip(owner, scores):
            results[n] = (results[n][0] + logp, results[n][1] and greedy)
        for req, answer in zip(requests, results):
            if req[0] is not None:
                self.cache_hook.add_partial("loglikelihood", req[0], answer)
        return results

    def _score_windows(self, windows: list[tuple[list[int], list[int]]],
                       disable_tqdm: bool) -> list[tuple[float, bool]]:
        """(log p(chunk | context), greedy) per window; a window's context + chunk is at most max_length + 1."""
        inputs = [(ctx + cont)[:-1] for ctx, cont in windows]
        rank, world = self.ranks
        self.check_same_work(len(windows), "windows to score")
        batches = batch_by_length([len(x) for x in inputs], self.batch_size)
        mine = batches[rank::world]
        scores: dict[int, tuple[float, bool]] = {}
        # every rank runs as many forward passes (a partitioned model gathers its parameters on all ranks at once)
        for n in tqdm(range(-(-len(batches) // world)), disable=disable_tqdm or rank > 0, desc="moep_ds loglikelihood"):
            if n >= len(mine):  # this rank's batches are done: run the model for the others
                self.model(torch.tensor([[self.eot_token_id]], device=self.device))
                continue
            rows = [inputs[i] for i in mine[n]]
            logits_BTV = self.model(right_pad(rows, self.eot_token_id).to(self.device)).logits
            conts = [windows[i][1] for i in mine[n]]
            scores.update(zip(mine[n], continuation_logprobs(logits_BTV, rows, conts)))
        if world > 1:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, scores)
            scores = {i: answer for part in gathered for i, answer in part.items()}
        return [scores[i] for i in range(len(windows))]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood: the document as a continuation of the end-of-text token, scored in the
        disjoint windows of max_length tokens of lm-eval's rolling scheme (`continuation_windows`)."""
        scored = [(None, [self.prefix_token_id], self.tok_encode(text)) for (text,) in (req.args for req in requests)]
        totals = [logp for logp, _ in self._loglikelihood_tokens(scored, disable_tqdm=disable_tqdm)]
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        self.check_same_work(len(requests), "generation requests")
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="moep_ds generate"):
            context, gen_kwargs = req.args
            text = self.generate_one(context, dict(gen_kwargs or {}))
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def generate_one(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        """Decode (greedy unless do_sample) until a stop string, end of text or max_gen_toks new tokens."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = min(int(gen_kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS)), self.max_length - 1)
        sample = bool(gen_kwargs.pop("do_sample", False)) and float(gen_kwargs.get("temperature", 1.0)) > 0
        ids = (self.tok_encode(context) or [self.prefix_token_id])[-(self.max_length - max_new):]
        # a token-choice or top-k router is not causal over a growing sequence: recompute instead of caching
        use_cache = "topk" not in self.routing_eval_mode.values()
        steps = decode_steps(self.model, torch.tensor([ids], device=self.device), use_cache=use_cache,
                             temperature=float(gen_kwargs.get("temperature", 1.0)) if sample else 0.0,
                             top_k=gen_kwargs.get("top_k"), top_p=gen_kwargs.get("top_p"))
        new: list[int] = []
        with eval_mode(self.model):
            for next_B in steps:
                token = int(next_B[0])  # rank 0's on every rank of a split model (decode_steps)
                if token == self.eot_token_id:
                    break
                new.append(token)
                text = self.tok_decode(new)
                cut = [text.index(s) for s in until if s in text]
                if cut:
                    return text[:min(cut)]
                if len(new) >= max_new:
                    break
        return self.tok_decode(new)


    def check_same_work(self, count: int, what: str) -> None:
        """Every rank of a split model must run the same forward passes: the same requests on every rank."""
        if self.ranks[1] == 1:
            return
        counts: list[Any] = [None] * self.ranks[1]
        dist.all_gather_object(counts, count)
        if len(set(counts)) > 1:
            raise SharedUserError(f"the ranks of a split model were given different work: {what} per rank {counts}")


def check_model_args(lm_eval_args: dict[str, Any]) -> None:
    """Refuse a model_args key this model does not know (a misspelled `dtpye=` would otherwise evaluate in fp32).

    lm-eval passes LM_EVAL_ARGS to every model: they are accepted and, being of no use here, ignored."""
    unknown = sorted(k for k in lm_eval_args if k not in LM_EVAL_ARGS)
    if unknown:
        raise SharedUserError(f"moep_ds model_args: unknown argument(s) {unknown}; known: {', '.join(MODEL_ARGS)}")
    given = sorted(k for k, v in lm_eval_args.items() if v is not None)
    if given:
        log.warning("moep_ds model ignores arguments %s", given)


def check_dtype(dtype: Any) -> None:
    if dtype not in DTYPES:
        raise SharedUserError(f"dtype ({dtype!r}) must be one of {', '.join(DTYPES)}")


def check_max_length(max_length: Any) -> None:
    """None (the model's max_seq_len) or a positive int; model_args arrive as parsed by lm-eval ('12' -> 12)."""
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise SharedUserError(f"max_length ({max_length!r}) must be a positive integer")


def as_bool(name: str, value: bool | str) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() not in ("true", "false", "1", "0"):
        raise SharedUserError(f"{name} ({value!r}) must be true or false")
    return str(value).lower() in ("true", "1")


def register() -> None:
    """Make `moep_ds` a name lm-eval's `--model` and `simple_evaluate(model=...)` know."""
    if "moep_ds" not in model_registry:
        model_registry.register("moep_ds")(MoepLM)


register()


def run_tasks(lm: MoepLM, tasks: list[str], manager: Any, *, limit: int | float | None = None,
              num_fewshot: int | None = None, bootstrap_iters: int = 0) -> dict[str, Any] | None:
    """Score `tasks` with lm-eval's `simple_evaluate` over `lm`: the one entry point of moep-eval (cli/eval.py)
    and of the in-loop evaluation (training/callbacks/downstream_eval.py). None on ranks other than 0."""
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                           bootstrap_iters=bootstrap_iters, log_samples=False)

