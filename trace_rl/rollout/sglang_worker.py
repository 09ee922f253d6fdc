"""Rollout on running patched SGLang servers (`rollout_backend = "sglang"`), over their HTTP API.

A `SGLangWorker` sends one `Request` to one server as a batched `/generate` (`input_ids`, `sampling_params`,
`return_logprob`, one `rid` per row = `<trajectory>#<attempt>`, `trace_core.records.store.rollout_rid`). Every field of
each answer is validated at the boundary (`meta_info`, output ids in the vocabulary, finite log-probs <= 0; errors
name the server). The server writes each finished request's records into its `--trace-store` under its current
weight version, bound to (step, policy version, trajectory, attempt, token digest), and names them in
`meta_info["trace"]`; the worker checks every handle against the request and the policy version it pushed (a
mismatch is a stale rollout: an error), then waits until a shard bound to exactly this attempt and these tokens is
on disk (shards of earlier attempts do not count), or a failure marker of the server says it will not come.
Waiting reads each new shard header once (`StepWatcher`). In `bf16` mode the server runs SGLang's own numerics
(`--trace-mode off`) and records nothing: it returns each answer's routes (`--enable-return-routed-experts`), and
the worker writes them into the store as the request's shard, bound the same way, for R3. At start-up the pool
reads every server's `--trace-*` settings from `/server_info` and refuses one whose capture policy (record bits, MoE
and attention layers, recipe) is not the trainer's (`SGLangWorker.check_policy`; bf16: one that runs TRACE or
returns no routes).

With `sglang_api_key` / `sglang_admin_api_key` (references `env:VARIABLE` or `file:PATH`, read at start, never
logged), every call carries `Authorization: Bearer <key>`: the API key on `/generate` and `/model_info`, the admin
key (or the API key when there is none) on the weight updates, as SGLang's --api-key / --admin-api-key
expect.

Every HTTP call has a wall-clock deadline (`trace_rl.http_deadline`: connect to last byte), `sglang_timeout_s`, or
less when the enclosing start-up (`sglang_start_timeout_s`) or weight sync (`weight_sync_timeout_s`) ends sooner.
An answer's text is redacted of the keys before anything reads it, so no error message or log can carry a key a
server echoes.

`SGLangPool` is the pool the controller drives (`run`, `load_weights`, `versions`, as `LocalPool`): weight sync
(`trace_rl.weight_sync`, `weight_sync = "disk" | "tensor" | "distributed"`) moves the trainer's HF tensors to every
server (through `<out_dir>/weights/v<version>` and `/update_weights_from_disk`, buckets of CUDA IPC handles through
`/update_weights_from_tensor`, or broadcasts over a weight-update group formed at start-up), each with
`weight_version=str(version)`, then checks that `/model_info` reports that version. A server failure raises with the
server URL and its response, and disk stands in for a failed tensor / distributed sync only with
`weight_sync_disk_fallback` (counted in the step metrics). The one retry: with servers the launcher started
(`trace_rl.servers.ServerGroup`), a server whose process died is started again, brought to the current policy and
given its requests again as new attempts, at most `sglang_max_restarts` times. With `colocate` the pool releases the
servers' GPU memory before each trainer step and resumes it around the weight sync (`trace_rl.rollout.colocate`).
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig

from sglang_trace.config import served_counters, served_layout_mismatch, served_spec
from sglang_trace.handle import from_meta_info
from trace_core.records.layout import TrajectoryRecords
from trace_core.records.spec import Binding, RecordSpec, token_digest
from trace_core.records.store import StepWatcher, StepWriter, rollout_rid
from trace_rl.config import RLConfig
from trace_rl.http_deadline import DeadlineExceeded, call
from trace_rl.policy import RolloutTask
from trace_rl.rollout.colocate import MemoryHandoff
from trace_rl.rollout.engine import Trajectory
from trace_rl.rollout.workers import Request, RolloutTimeout
from trace_rl.servers import EXIT_GRACE_S
from trace_rl.task import EOS
from trace_rl.weight_sync import WeightSync

if TYPE_CHECKING:
    from trace_rl.servers import ServerGroup

WEIGHTS_DIR = "weights"
# First and longest pause between looks at the store while waiting for records. A look reads only new shards'
# headers, so looking every 20 ms costs little, while a ladder up to 0.5 s made a wait up to twice the records' delay.
POLL_S = (0.005, 0.02)
HANDLE_KEYS = ("store", "step", "trajectory", "attempt", "policy_version", "tokens")  # token digest: in the shard


class SGLangError(RuntimeError):
    """An SGLang server answered with an error or with a response the worker cannot use."""


class StaleRolloutHandle(SGLangError):
    """A server wrote a request's records under another step or weight version than the policy it should serve."""


def read_secret(ref: str, name: str) -> str | None:
    """The secret a config reference names: `env:VARIABLE` or `file:PATH` (None for ""); errors never show it."""
    if not ref:
        return None
    kind, _, where = ref.partition(":")
    if kind == "env":
        value = os.environ.get(where, "")
        if not value:
            raise SGLangError(f"{name}={ref!r}: environment variable {where} is not set or empty")
    else:
        try:
            value = Path(where).read_text().strip()
        except OSError as e:
            raise SGLangError(f"{name}={ref!r}: cannot read the key file ({e.strerror})") from None
        if not value:
            raise SGLangError(f"{name}={ref!r}: the key file is empty")
    return value


class SGLangWorker:
    """One patched SGLang server at `url`, serving the policy version it was last updated to; `vocab_size` bounds
    the token ids it may answer with, `eos` ends a response."""

    def __init__(
        self,
        url: str,
        cfg: RLConfig,
        vocab_size: int,
        eos: tuple[int, ...] = (EOS,),
        *,
        deadline: float | None = None,
    ):
        """`deadline` (a `time.monotonic()` instant): the start-up's, for the first `/model_info`."""
        self.url, self.cfg, self.vocab_size, self.eos = url.rstrip("/"), cfg, vocab_size, eos
        self._keys = {
            False: read_secret(cfg.sglang_api_key, "sglang_api_key"),
            True: read_secret(cfg.sglang_admin_api_key, "sglang_admin_api_key")
            or read_secret(cfg.sglang_api_key, "sglang_api_key"),
        }
        self.headers_read = 0  # shard headers read while waiting for records (each new shard once)
        self.bf16 = cfg.mode == "bf16"  # TRACE off on the server: the worker stores the answers' routes
        self.route_shape: tuple[int, int, int | None] | None = None  # bf16: (layers, top-k, experts), set by the pool
        self.record_wait_s = 0.0  # seconds after answers spent until their records were in the store
        self._wait_lock = threading.Lock()
        self._info: dict | None = None  # /server_info, read once
        self._model_info: dict = {}  # the last /model_info answer
        self._last_update: tuple[str, object] = ("no update", None)
        self._version = self.version(deadline=deadline, budget="sglang_start_timeout_s")

    # ----------------------------------------------------------------- HTTP
    def _redact(self, text: str) -> str:
        """`text` with every key this worker sends replaced: a server may echo request headers in an error."""
        for key in {k for k in self._keys.values() if k}:
            text = text.replace(key, "<redacted>")
        return text

    def _call(
        self,
        method: str,
        endpoint: str,
        payload: dict | None = None,
        *,
        admin: bool = False,
        deadline: float | None = None,
        budget: str = "",
    ) -> object:
        """One call, all of it (connect to last body byte) within `sglang_timeout_s` of wall-clock time and before
        `deadline` (a `time.monotonic()` instant of the enclosing start-up or sync, named `budget`). The answer's
        text is redacted of the keys before anything reads it, so no error message or log can carry them."""
        where = f"{self.url}{endpoint}"
        key = self._keys[admin]
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        seconds, limit = self.cfg.sglang_timeout_s, f"sglang_timeout_s={self.cfg.sglang_timeout_s}"
        if deadline is not None and deadline - time.monotonic() < seconds:
            seconds, limit = deadline - time.monotonic(), f"{budget}'s deadline"
        if seconds <= 0:
            raise SGLangError(f"SGLang server {where}: not called, {limit} has passed")
        try:
            status, body = call(method, where, payload, headers, seconds)
        except DeadlineExceeded:
            raise SGLangError(f"SGLang server {where}: no complete answer within {limit}") from None
        except (OSError, http.client.HTTPException) as e:
            raise SGLangError(f"SGLang server {where}: {type(e).__name__}: {self._redact(str(e))}") from None
        text = self._redact(body.decode(errors="replace"))
        if status in (401, 403):
            which = "sglang_admin_api_key" if admin else "sglang_api_key"
            raise SGLangError(
                f"SGLang server {where}: HTTP {status}: the server refused the request's credentials "
                f"({'a key was' if key else 'no key was'} sent; set {which} to a reference to the server's "
                f"{'--admin-api-key' if admin else '--api-key'})"
            )
        if status != 200:
            raise SGLangError(f"SGLang server {where}: HTTP {status}: {text[:2000]}")
        try:
            return json.loads(text)
        except ValueError:
            raise SGLangError(f"SGLang server {where}: response is not JSON: {text[:2000]}") from None

    def version(self, *, deadline: float | None = None, budget: str = "") -> int:
        """The server's `weight_version` from `/model_info`, which TRACE needs to be an integer policy version."""
        info = self._call("GET", "/model_info", deadline=deadline, budget=budget)
        self._model_info = info if isinstance(info, dict) else {}
        version = self._model_info.get("weight_version")
        try:
            return int(version)
        except (TypeError, ValueError):
            raise SGLangError(
                f"SGLang server {self.url}/model_info reports weight_version={version!r}; TRACE needs an integer "
                "policy version (start the server with --weight-version 0 --trace-step 0)"
            ) from None

    def check_policy(self, spec: RecordSpec, hf_config, *, deadline: float | None = None, budget: str = "") -> None:
        """SGLangError unless the server runs the trainer's model (`_check_model`) and captures exactly `spec` (bits,
        MoE and attention layers, recipe), read from its `/server_info` (its `--trace-*` settings) on the model's HF
        config: a server recording another policy would leave the trainer's sites without records, and the trainer
        would fall back to RTN there."""
        info = self._call("GET", "/server_info", deadline=deadline, budget=budget)
        self._info = info if isinstance(info, dict) else {}
        self._check_model(hf_config)
        if self.cfg.mode == "bf16":
            self._check_bf16(self._info)
            return
        try:
            served = served_spec(info if isinstance(info, dict) else {}, hf_config)
        except ValueError as e:
            raise SGLangError(f"SGLang server {self.url}/server_info: {e}") from None
        diff = [
            f"{name}: server {getattr(served, name)!r}, trainer {getattr(spec, name)!r}"
            for name in ("bits", "moe_layers", "attn_layers", "recipe")
            if getattr(served, name) != getattr(spec, name)
        ]
        if diff:
            raise SGLangError(
                f"SGLang server {self.url} captures another policy than the trainer guides with ({'; '.join(diff)}): "
                "start it with --trace-record-bits / --trace-layers / --trace-sites / --trace-recipe matching the "
                "config's record_bits, record_all_layers and recipe"
            )

    def _check_model(self, hf_config) -> None:
        """SGLangError unless the server runs the trainer's model: the architectures of its `/model_info`, and with
        TRACE on the layout its capturer reports (layers, MoE and attention layer ids, widths, heads, top-k,
        experts: `served_layout_mismatch`). Another model would sample tokens the trainer scores with other weights,
        and its records and routes would not fit the trainer's sites."""
        served, mine = self._model_info.get("architectures"), list(getattr(hf_config, "architectures", None) or [])
        diff = [] if served == mine else [f"architectures: server {served!r}, trainer {mine!r}"]
        if not diff and (self._info or {}).get("trace_mode", "off") != "off":
            try:
                diff = served_layout_mismatch(self._info or {}, hf_config)
            except ValueError as e:
                raise SGLangError(f"SGLang server {self.url}/server_info: {e}") from None
        if diff:
            raise SGLangError(
                f"SGLang server {self.url} serves another model ({self._model_info.get('model_path')!r}) than the "
                f"trainer's ({self.cfg.model_dir!r}): {'; '.join(diff)}"
            )

    def _check_bf16(self, info: dict) -> None:
        """mode = bf16: SGLangError unless the server runs SGLang's own numerics (`--trace-mode off`: BF16 experts
        and KV cache) and returns each answer's routes (`--enable-return-routed-experts`), which R3 replays."""
        problems = []
        if info.get("trace_mode", "off") != "off":
            problems.append(
                f"it runs --trace-mode {info.get('trace_mode')} (FP4 numerics); start it with --trace-mode off"
            )
        if info.get("enable_return_routed_experts") is not True:
            problems.append("it does not return routes: start it with --enable-return-routed-experts")
        if problems:
            raise SGLangError(f"SGLang server {self.url} cannot serve mode='bf16': {'; '.join(problems)}")

    # ----------------------------------------------------------------- rollout
    def generate(self, req: Request) -> list[Trajectory]:
        """Sample one response per row of `req`; the server writes the records (trajectory id = row). In bf16
        mode the server records nothing: the worker stores the routes each answer carries (`_store_routes`)."""
        if not 0 <= req.step - self._version <= self.cfg.async_lag:
            raise StaleRolloutHandle(
                f"request for rollout step {req.step} sent to {self.url}, which serves policy version "
                f"{self._version}: a rollout runs 0 to async_lag={self.cfg.async_lag} steps ahead of its policy"
            )
        prompts = [p.tolist() for p in req.prompts]
        payload = {
            "input_ids": prompts,
            "rid": [rollout_rid(str(r), req.attempt, req.step) for r in req.rows],
            "sampling_params": {
                "max_new_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature,
                "stop_token_ids": list(self.eos),
            },
            "return_logprob": True,
        }
        if self.bf16:
            payload["return_routed_experts"] = True
        outs = self._call("POST", "/generate", payload)
        if not isinstance(outs, list) or len(outs) != len(prompts):
            raise SGLangError(f"SGLang server {self.url}/generate: expected {len(prompts)} outputs, got {outs!r:.2000}")
        trajs = [
            self._trajectory(req, row, prompt, out) for row, prompt, out in zip(req.rows, prompts, outs, strict=True)
        ]
        start = time.monotonic()
        try:
            if self.bf16:
                self._store_routes(req, trajs, outs)
            else:
                self._wait_for_records(req, trajs)
        finally:
            with self._wait_lock:
                self.record_wait_s += time.monotonic() - start
        return trajs

    def _output(self, where: str, prompt: list[int], out: object) -> tuple[list[int], list[float], dict]:
        """Output ids, log-probs and meta_info of one answer, every field checked (errors name `where`)."""
        if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
            raise SGLangError(f"{where}: answer lacks meta_info: {out!r:.2000}")
        output_ids, meta = out.get("output_ids"), out["meta_info"]
        if not isinstance(output_ids, list) or not 1 <= len(output_ids) <= self.cfg.max_new_tokens:
            raise SGLangError(
                f"{where}: output_ids must be a list of 1..{self.cfg.max_new_tokens} ids: {output_ids!r:.500}"
            )
        bad = [t for t in output_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise SGLangError(
                f"{where}: output_ids {bad[:8]} are not token ids of the vocabulary (0..{self.vocab_size - 1})"
            )
        finish = meta.get("finish_reason")
        if not isinstance(finish, dict) or finish.get("type") not in ("length", "stop"):
            raise SGLangError(f"{where}: request did not finish normally: finish_reason {finish!r:.500}")
        if meta.get("prompt_tokens") != len(prompt) or meta.get("completion_tokens", len(output_ids)) != len(
            output_ids
        ):
            raise SGLangError(
                f"{where}: meta_info counts prompt_tokens={meta.get('prompt_tokens')!r}, completion_tokens="
                f"{meta.get('completion_tokens')!r}; the request has {len(prompt)} and the answer {len(output_ids)}"
            )
        logprobs = meta.get("output_token_logprobs")
        if not isinstance(logprobs, list) or len(logprobs) != len(output_ids):
            raise SGLangError(f"{where}: output_token_logprobs must hold one entry per output id: {logprobs!r:.500}")
        values = []
        for pos, (entry, tok) in enumerate(zip(logprobs, output_ids, strict=True)):
            if not isinstance(entry, list | tuple) or len(entry) < 2 or entry[1] != tok:
                raise SGLangError(f"{where}: output_token_logprobs[{pos}] = {entry!r:.200} does not name token {tok}")
            lp = entry[0]
            if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp) or lp > 0:
                raise SGLangError(f"{where}: log-prob of output token {pos} is {lp!r}, not a finite value <= 0")
            values.append(float(lp))
        return output_ids, values, meta

    def _trajectory(self, req: Request, row: int, prompt: list[int], out: object) -> Trajectory:
        where = f"SGLang server {self.url}/generate, trajectory {row}"
        output_ids, logprobs, meta = self._output(where, prompt, out)
        rid = rollout_rid(str(row), req.attempt, req.step)
        if meta.get("id") != rid:
            raise SGLangError(f"{where}: answer for request id {meta.get('id')!r}, not {rid!r}")
        if self.bf16:
            if str(meta.get("weight_version")) != str(self._version):
                raise StaleRolloutHandle(
                    f"{where}: answered by weight_version {meta.get('weight_version')!r}, but the worker pushed policy "
                    f"version {self._version} for rollout step {req.step}"
                )
            tokens = prompt + output_ids
            return Trajectory(
                torch.tensor(tokens),
                len(prompt),
                torch.tensor(logprobs),
                records=None,
                recorded=len(tokens) - 1,
                attempt=req.attempt,
            )
        try:
            handle = from_meta_info(meta)
        except ValueError as e:
            raise SGLangError(f"{where}: {e}") from None
        if not isinstance(handle, dict):
            raise SGLangError(f"{where}: no meta_info['trace'] handle (is the server started with --trace-mode?)")
        tokens = prompt + output_ids
        expected = {
            "store": str(Path(req.store).resolve()),
            "step": req.step,
            "trajectory": str(row),
            "attempt": req.attempt,
            "policy_version": self._version,
            "tokens": len(tokens) - 1,
        }
        got = {k: handle.get(k) for k in HANDLE_KEYS}
        if isinstance(got["store"], str):
            got["store"] = str(Path(got["store"]).resolve())
        stale = got["policy_version"] != self._version or str(meta.get("weight_version")) != str(self._version)
        if stale or got["step"] != req.step:
            raise StaleRolloutHandle(
                f"{where}: records of step {got['step']} by policy version {got['policy_version']} (weight_version "
                f"{meta.get('weight_version')!r}), but the worker pushed policy version {self._version} for rollout "
                f"step {req.step}"
            )
        if got != expected:
            diff = {k: got[k] for k in HANDLE_KEYS if got[k] != expected[k]}
            raise SGLangError(f"{where}: record handle fields {diff} do not match the request (expected {expected})")
        return Trajectory(
            torch.tensor(tokens),
            len(prompt),
            torch.tensor(logprobs),
            records=None,
            recorded=expected["tokens"],
            attempt=req.attempt,
        )

    def _store_routes(self, req: Request, trajs: list[Trajectory], outs: list) -> None:
        """bf16 mode: one shard of the request's routes (`meta_info["routed_experts"]`: SGLang's R3 capture, int32
        `[tokens - 1, layers, top-k]` in base64, every position the server fed forward), bound to this step, policy
        version, trajectory, attempt and tokens, written into the step's store directory as a server would."""
        if self.route_shape is None:
            raise SGLangError("SGLangWorker.route_shape (layers, top-k, experts) must be set for mode='bf16'")
        layers, topk, experts = self.route_shape
        records = {}
        for row, t, out in zip(req.rows, trajs, outs, strict=True):
            where = f"SGLang server {self.url}/generate, trajectory {row}"
            text = out["meta_info"].get("routed_experts")
            if not isinstance(text, str):
                raise SGLangError(
                    f"{where}: no meta_info['routed_experts'] (start the server with --enable-return-routed-experts)"
                )
            try:
                raw = base64.b64decode(text, validate=True)
            except ValueError:
                raise SGLangError(f"{where}: meta_info['routed_experts'] is not base64") from None
            n = len(t.tokens) - 1
            if len(raw) != 4 * n * layers * topk:
                raise SGLangError(
                    f"{where}: meta_info['routed_experts'] holds {len(raw) // 4} ids, not {n} positions x {layers} "
                    f"layers x top-{topk}"
                )
            routes = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(n, layers, topk)
            if experts is not None and bool(((routes < 0) | (routes >= experts)).any()):
                raise SGLangError(f"{where}: routed expert ids outside 0..{experts - 1}")
            binding = Binding(req.step, self._version, str(row), req.attempt, token_digest(t.tokens), self.cfg.recipe)
            records[str(row)] = TrajectoryRecords(n, {}, routes, binding)
        StepWriter(req.store, req.step).write(records)

    def _wait_for_records(self, req: Request, trajs: list[Trajectory]) -> None:
        """The server writes shards on a background thread after answering: wait until every row has a shard bound
        to this attempt and these tokens; shards of earlier attempts do not count."""
        want = {
            str(r): Binding(req.step, self._version, str(r), req.attempt, token_digest(t.tokens), self.cfg.recipe)
            for r, t in zip(req.rows, trajs, strict=True)
        }
        watcher = StepWatcher(req.store, req.step)
        deadline, pause = time.monotonic() + self.cfg.sglang_timeout_s, POLL_S[0]
        try:
            while True:
                found = watcher.refresh()
                missing = [r for r, b in want.items() if b not in {got for _, got in found.get(r, [])}]
                if not missing:
                    return
                failed = {r: watcher.failed[(r, req.attempt)] for r in missing if (r, req.attempt) in watcher.failed}
                if failed:
                    raise SGLangError(f"SGLang server {self.url}: could not store the records of trajectories {failed}")
                if time.monotonic() > deadline:
                    stale = {r: [shard for shard, _ in found[r]] for r in missing if r in found}
                    raise SGLangError(
                        f"SGLang server {self.url}: records of trajectories {sorted(missing, key=int)} did not reach "
                        f"{watcher.dir} within sglang_timeout_s={self.cfg.sglang_timeout_s} (attempt {req.attempt})"
                        + (f"; shards of other attempts or tokens, not used: {stale}" if stale else "")
                    )
                time.sleep(pause)
                pause = min(2 * pause, POLL_S[1])
        finally:
            self.headers_read += watcher.headers_read

    # ----------------------------------------------------------------- weights
    @property
    def server_info(self) -> dict:
        """The server's `/server_info` (its server args), read once."""
        if self._info is None:
            info = self._call("GET", "/server_info")
            self._info = info if isinstance(info, dict) else {}
        return self._info

    def trace_counters(self) -> dict | None:
        """The server's TRACE finish-path counters now (`/server_info` `internal_states[0]["trace"]`, a fresh read:
        requests, scheduler-thread `finish_s`, writer `write_s`, host bytes, host-ring waits); None when the server
        runs no TRACE capturer (`--trace-mode off`)."""
        info = self._call("GET", "/server_info")
        return served_counters(info if isinstance(info, dict) else {})

    @property
    def tp_size(self) -> int:
        """The server's tensor-parallel size: its ranks in a weight update (one tensor payload each)."""
        size = self.server_info.get("tp_size", 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise SGLangError(f"SGLang server {self.url}/server_info reports tp_size={size!r}")
        return size

    def post_update(self, endpoint: str, payload: dict, *, deadline: float | None = None) -> dict:
        """One weight-update call (admin key) before `deadline` (the sync's, `weight_sync_timeout_s`); SGLangError
        naming the server unless it answers `success: true`."""
        resp = self._call("POST", endpoint, payload, admin=True, deadline=deadline, budget="weight_sync_timeout_s")
        if not isinstance(resp, dict) or resp.get("success") is not True:
            raise SGLangError(f"SGLang server {self.url}{endpoint} failed: {resp!r:.2000}")
        self._last_update = (endpoint, resp)
        return resp

    def check_version(self, version: int, *, deadline: float | None = None) -> None:
        """SGLangError unless `/model_info` reports `version` after an update (naming the update's last answer)."""
        reported = self.version(deadline=deadline, budget="weight_sync_timeout_s")
        if reported != version:
            endpoint, resp = self._last_update
            raise SGLangError(
                f"SGLang server {self.url}: {endpoint} answered {resp!r:.500} but /model_info reports weight_version "
                f"{reported}, not {version}"
            )
        self._version = version

    def post_memory(self, endpoint: str, tags: list[str]) -> None:
        """`/release_memory_occupation` or `/resume_memory_occupation` of `tags` (admin key; `colocate`,
        `trace_rl.rollout.colocate`); SGLangError naming the server unless it answers 200."""
        self._call("POST", endpoint, {"tags": tags}, admin=True)

    def reconnect(self, *, deadline: float | None = None) -> None:
        """After the server was started again: forget its `/server_info` and read its weight version anew."""
        self._info = None
        self._last_update = ("no update since its restart", None)
        self._version = self.version(deadline=deadline, budget="sglang_start_timeout_s")

    def update_weights(self, path: Path, version: int, *, deadline: float | None = None) -> None:
        """`/update_weights_from_disk` of the HF checkpoint at `path` as policy `version`, then check the version;
        both calls before `deadline` (the sync's, `weight_sync_timeout_s`)."""
        self.post_update(
            "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)}, deadline=deadline
        )
        self.check_version(version, deadline=deadline)


class SGLangPool:
    """One `SGLangWorker` per URL of `cfg.sglang_urls`; requests run concurrently, one server each.

    With `servers` (the launcher's `trace_rl.servers.ServerGroup`), a server whose process has exited is started
    again (`ServerGroup.restart`, at most `sglang_max_restarts` times) when the pool next needs it: before a request,
    after a failed request (which then runs again as a new attempt: its earlier attempt's shard, if any, is set aside
    when the step is finalized), and around a weight sync. A restarted server comes back at version 0 with the
    checkpoint's weights; before it serves a request it gets the pool's policy version (by disk from the kept export,
    else `policy()`, the trainer's current HF tensors, by the configured transport; a `distributed` group is formed
    again with every server). With `cfg.colocate` the pool releases and resumes the servers' GPU memory
    (`trace_rl.rollout.colocate.MemoryHandoff`)."""

    def __init__(
        self,
        cfg: RLConfig,
        spec: RecordSpec,
        task: RolloutTask,
        *,
        servers: ServerGroup | None = None,
        policy: Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ):
        self.cfg, self.spec, self.servers, self.policy = cfg, spec, servers, policy
        self.hf_config = Path(task.hf_dir) / "config.json"
        vocab = json.loads(self.hf_config.read_text())["vocab_size"]
        deadline = time.monotonic() + cfg.sglang_start_timeout_s  # reaching every server, each call bounded too
        self.workers = [SGLangWorker(url, cfg, vocab, task.eos, deadline=deadline) for url in cfg.sglang_url_list()]
        self.hf = AutoConfig.from_pretrained(task.hf_dir)
        experts = getattr(self.hf, "num_experts", None) or getattr(self.hf, "num_local_experts", None)
        for worker in self.workers:  # one capture policy: each server's must be the trainer's
            worker.route_shape = (self.hf.num_hidden_layers, self.hf.num_experts_per_tok, experts)
            worker.check_policy(spec, self.hf, deadline=deadline, budget="sglang_start_timeout_s")
        self.memory = MemoryHandoff(self.workers) if cfg.colocate else None
        self.weights_root = (Path(cfg.out_dir) / WEIGHTS_DIR).resolve()
        self.sync = WeightSync(cfg, self.workers, Path(task.hf_dir), self.weights_root)  # forms a group at start-up
        self.version: int | None = None  # the policy version last pushed to every server
        self.generations = list(servers.generations) if servers is not None else []
        self._locks = [threading.Lock() for _ in self.workers]

    def trace_counters(self) -> list[dict | None]:
        """Every server's TRACE finish-path counters (`SGLangWorker.trace_counters`), in server order."""
        return [w.trace_counters() for w in self.workers]

    # ----------------------------------------------------------------- dead servers
    def _dead(self, indices: Sequence[int], grace_s: float = 0.0) -> list[int]:
        """The servers of `indices` whose process has exited, waiting up to `grace_s` for one to show."""
        if self.servers is None:
            return []
        end = time.monotonic() + grace_s
        while True:
            dead = [i for i in indices if self.servers.exited(i) is not None]
            if dead or time.monotonic() >= end:
                return dead
            time.sleep(0.05)

    def _revive(self, i: int, *, sync: bool = True) -> bool:
        """Server `i` started again if its process has exited (ServerGroupError past `sglang_max_restarts`), its
        worker re-read and its capture policy checked; with `sync` it is brought to the pool's policy version.
        True if it was restarted since the pool last looked."""
        if self.servers is None:
            return False
        with self._locks[i]:
            self.servers.restart(i)  # nothing if it runs
            if self.servers.generations[i] == self.generations[i]:
                return False
            self.generations[i] = self.servers.generations[i]
            deadline = time.monotonic() + self.cfg.sglang_start_timeout_s
            worker = self.workers[i]
            worker.reconnect(deadline=deadline)
            worker.check_policy(self.spec, self.hf, deadline=deadline, budget="sglang_start_timeout_s")
            if self.memory is not None:
                self.memory.awake(i)
            if sync and self.version is not None and worker._version != self.version:
                self.sync.catch_up([i], self.version, self.policy)
            return True

    # ----------------------------------------------------------------- rollout
    def run(self, requests_: Sequence[Request]) -> tuple[list[list[Trajectory]], int]:
        """Results in request order and the server restarts the step took. A request whose server died runs again
        as a new attempt on the restarted server; any other failure is an error, so is a step that does not finish
        within `rollout_step_timeout_s` (each HTTP call is bounded by `sglang_timeout_s`)."""
        if self.memory is not None and self.memory.asleep:
            raise SGLangError(
                "colocate: a rollout was asked of servers whose memory is released; load_weights (resume, sync) "
                "comes first"
            )
        restarts = [0]
        count = threading.Lock()

        def one(req: Request) -> list[Trajectory]:
            w = req.index % len(self.workers)
            while True:
                if self._revive(w):
                    with count:
                        restarts[0] += 1
                try:
                    return self.workers[w].generate(req.next_attempt())
                except Exception:
                    if not self._dead([w], EXIT_GRACE_S):
                        raise

        ex = ThreadPoolExecutor(max_workers=len(self.workers))
        try:
            futures = [ex.submit(one, r) for r in requests_]
            deadline = time.monotonic() + self.cfg.rollout_step_timeout_s
            try:
                return [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futures], restarts[0]
            except TimeoutError:
                raise RolloutTimeout(
                    f"step {requests_[0].step}: SGLang rollout did not finish within rollout_step_timeout_s="
                    f"{self.cfg.rollout_step_timeout_s}"
                ) from None
        finally:
            ex.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- colocation
    def release_memory(self) -> float:
        """`colocate`: every server releases its GPU memory for the trainer step (a server found dead is started
        again first, and released too). Seconds taken."""
        if self.memory is None:
            return 0.0
        start = time.perf_counter()
        for i in range(len(self.workers)):
            self._revive(i, sync=False)  # the sync after the trainer step gives it the new policy
        try:
            self.memory.release()
        except Exception:
            dead = self._dead(range(len(self.workers)), EXIT_GRACE_S)
            if not dead:
                raise
            for i in dead:
                self._revive(i, sync=False)
            self.memory.release()
        return time.perf_counter() - start

    # ----------------------------------------------------------------- weights
    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Every server serves `tensors` as policy `version` (`weight_sync`: disk, tensor or distributed, then the
        `/model_info` check); the sync's metrics (`trace_rl.weight_sync.WeightSync.push`), the servers restarted
        during it (`weight_sync/restarts`) and, with `colocate`, `time/resume_s` (resuming the weights before the
        sync and the KV cache and CUDA graphs after it)."""
        everyone = range(len(self.workers))
        revived = [i for i in everyone if self._revive(i, sync=False)]  # the push gives them this version
        self.sync.rejoin(revived)
        resume_s = self.memory.resume_weights() if self.memory is not None else 0.0
        while True:
            try:
                metrics = self.sync.push(tensors, version)
                break
            except Exception:
                dead = self._dead(everyone, EXIT_GRACE_S)
                if not dead:
                    raise
                again = [i for i in dead if self._revive(i, sync=False)]
                revived += again
                self.sync.rejoin(again)
        self.version = version
        metrics["weight_sync/restarts"] = float(len(revived))
        if self.memory is not None:
            metrics["time/resume_s"] = resume_s + self.memory.resume_rest()
        return metrics

    def take_record_wait(self) -> float:
        """Seconds the rollouts since the last call spent after their answers, until their records were in the store
        (bf16: the routes stored); the longest over the servers, whose requests run concurrently."""
        waits = []
        for w in self.workers:
            with w._wait_lock:
                waits.append(w.record_wait_s)
                w.record_wait_s = 0.0
        return max(waits, default=0.0)

    def close(self) -> None:
        """Leave the weight-update group (`weight_sync = "distributed"`)."""
        self.sync.close()

    def versions(self) -> list[int]:
        return [w.version() for w in self.workers]
