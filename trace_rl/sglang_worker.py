"""Rollout on running patched SGLang servers (`rollout_backend = "sglang"`), over their HTTP API.

A `SGLangWorker` sends one `Request` to one server as a batched `/generate` (`input_ids`, `sampling_params`,
`return_logprob`, one `rid` per row = the row's trajectory id in the record store). The server writes each finished
request's records into its `--trace-store` under its current weight version and names them in
`meta_info["trace"] = {store, step, trajectory, tokens}`; the worker checks every handle against the request (store,
step, trajectory id, `tokens` = prompt + response - 1) and the policy version it pushed (a mismatch is a stale
rollout: an error), then waits until the server's background writer has put the records on disk.

`SGLangPool` is the pool the controller drives (`run`, `load_weights`, `versions`, as `LocalPool`): weight sync
writes the trainer's HF tensors as safetensors into `<out_dir>/weights/v<version>` (a directory the servers must
see) and calls every server's `/update_weights_from_disk` with `weight_version=str(version)`, then checks that
`/model_info` reports that version. A server failure raises with the server URL and its response; nothing retries.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
from safetensors.torch import save_file

from trace_core.records import RecordSpec
from trace_core.store import build_index, step_dir
from trace_rl.config import RLConfig
from trace_rl.engine import Trajectory
from trace_rl.policy import RolloutTask
from trace_rl.task import EOS
from trace_rl.workers import Request

WEIGHTS_DIR = "weights"
STORE_POLL_S = 0.05


class SGLangError(RuntimeError):
    """An SGLang server answered with an error or with a response the worker cannot use."""


class StaleRolloutHandle(SGLangError):
    """A server wrote a request's records under another step or weight version than the policy it should serve."""


class SGLangWorker:
    """One patched SGLang server at `url`, serving the policy version it was last updated to."""

    def __init__(self, url: str, cfg: RLConfig, eos: tuple[int, ...] = (EOS,)):
        self.url, self.cfg, self.eos = url.rstrip("/"), cfg, eos
        self.session = requests.Session()
        self._version = self.version()

    # ----------------------------------------------------------------- HTTP
    def _call(self, method: str, endpoint: str, payload: dict | None = None) -> object:
        where = f"{self.url}{endpoint}"
        try:
            resp = self.session.request(method, where, json=payload, timeout=self.cfg.sglang_timeout_s)
        except requests.RequestException as e:
            raise SGLangError(f"SGLang server {where}: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise SGLangError(f"SGLang server {where}: HTTP {resp.status_code}: {resp.text[:2000]}")
        try:
            return resp.json()
        except ValueError:
            raise SGLangError(f"SGLang server {where}: response is not JSON: {resp.text[:2000]}") from None

    def version(self) -> int:
        """The server's `weight_version` from `/model_info`, which TRACE needs to be an integer policy version."""
        info = self._call("GET", "/model_info")
        version = info.get("weight_version") if isinstance(info, dict) else None
        try:
            return int(version)
        except (TypeError, ValueError):
            raise SGLangError(
                f"SGLang server {self.url}/model_info reports weight_version={version!r}; TRACE needs an integer "
                "policy version (start the server with --weight-version 0 --trace-step 0)"
            ) from None

    # ----------------------------------------------------------------- rollout
    def generate(self, req: Request) -> list[Trajectory]:
        """Sample one response per row of `req`; the server writes the records (trajectory id = row)."""
        if req.step != self._version:
            raise StaleRolloutHandle(
                f"request for rollout step {req.step} sent to {self.url}, which serves policy version "
                f"{self._version}; the server writes records under its weight version (needs async_lag = 0)"
            )
        prompts = [p.tolist() for p in req.prompts]
        payload = {
            "input_ids": prompts,
            "rid": [str(r) for r in req.rows],
            "sampling_params": {
                "max_new_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature,
                "stop_token_ids": list(self.eos),
            },
            "return_logprob": True,
        }
        outs = self._call("POST", "/generate", payload)
        if not isinstance(outs, list) or len(outs) != len(prompts):
            raise SGLangError(f"SGLang server {self.url}/generate: expected {len(prompts)} outputs, got {outs!r:.2000}")
        trajs = [
            self._trajectory(req, row, prompt, out) for row, prompt, out in zip(req.rows, prompts, outs, strict=True)
        ]
        self._wait_for_records(req)
        return trajs

    def _trajectory(self, req: Request, row: int, prompt: list[int], out: dict) -> Trajectory:
        where = f"SGLang server {self.url}/generate, trajectory {row}"
        try:
            output_ids, meta = out["output_ids"], out["meta_info"]
            logprobs = meta["output_token_logprobs"]
        except (KeyError, TypeError):
            raise SGLangError(
                f"{where}: response lacks output_ids / meta_info.output_token_logprobs: {out!r:.2000}"
            ) from None
        handle = meta.get("trace")
        if not isinstance(handle, dict):
            raise SGLangError(f"{where}: no meta_info['trace'] handle (is the server started with --trace-mode?)")
        if [int(t) for _, t, *_ in logprobs] != list(output_ids):
            raise SGLangError(f"{where}: output_token_logprobs do not match output_ids {output_ids}")
        expected = {
            "store": str(Path(req.store).resolve()),
            "step": self._version,
            "trajectory": str(row),
            "tokens": len(prompt) + len(output_ids) - 1,
        }
        got = {k: handle.get(k) for k in expected}
        if got["store"] is not None:
            got["store"] = str(Path(got["store"]).resolve())
        if got["step"] != expected["step"] or str(meta.get("weight_version")) != str(self._version):
            raise StaleRolloutHandle(
                f"{where}: records of step {got['step']} (weight_version {meta.get('weight_version')!r}), "
                f"but the worker pushed policy version {self._version} for rollout step {req.step}"
            )
        if got != expected:
            raise SGLangError(f"{where}: record handle {handle} does not match the request (expected {expected})")
        return Trajectory(
            torch.tensor(prompt + list(output_ids)),
            len(prompt),
            torch.tensor([float(lp) for lp, *_ in logprobs]),
            records=None,
            recorded=expected["tokens"],
        )

    def _wait_for_records(self, req: Request) -> None:
        """The server writes shards on a background thread after answering: wait until all rows are on disk."""
        directory, rows = step_dir(req.store, req.step), {str(r) for r in req.rows}
        deadline = time.monotonic() + self.cfg.sglang_timeout_s
        while not rows <= set(build_index(directory)):
            if time.monotonic() > deadline:
                missing = sorted(rows - set(build_index(directory)), key=int)
                raise SGLangError(
                    f"SGLang server {self.url}: records of trajectories {missing} did not reach {directory} within "
                    f"sglang_timeout_s={self.cfg.sglang_timeout_s}"
                )
            time.sleep(STORE_POLL_S)

    # ----------------------------------------------------------------- weights
    def update_weights(self, path: Path, version: int) -> None:
        """`/update_weights_from_disk` of the HF checkpoint at `path` as policy `version`, then check the version."""
        payload = {"model_path": str(path), "weight_version": str(version)}
        resp = self._call("POST", "/update_weights_from_disk", payload)
        if not isinstance(resp, dict) or resp.get("success") is not True:
            raise SGLangError(f"SGLang server {self.url}/update_weights_from_disk failed: {resp!r:.2000}")
        reported = self.version()
        if reported != version:
            raise SGLangError(
                f"SGLang server {self.url}: /update_weights_from_disk answered {resp!r:.500} but /model_info "
                f"reports weight_version {reported}, not {version}"
            )
        self._version = version


class SGLangPool:
    """One `SGLangWorker` per URL of `cfg.sglang_urls`; requests run concurrently, one server each."""

    def __init__(self, cfg: RLConfig, spec: RecordSpec, task: RolloutTask):
        self.cfg = cfg
        self.workers = [SGLangWorker(url, cfg, task.eos) for url in cfg.sglang_url_list()]
        self.weights_root = (Path(cfg.out_dir) / WEIGHTS_DIR).resolve()
        self.hf_config = Path(task.hf_dir) / "config.json"

    def run(self, requests_: Sequence[Request]) -> tuple[list[list[Trajectory]], int]:
        """Results in request order; no restarts (a server failure is an error)."""
        with ThreadPoolExecutor(max_workers=len(self.workers)) as ex:
            futures = [ex.submit(self.workers[r.index % len(self.workers)].generate, r) for r in requests_]
            return [f.result() for f in futures], 0

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Export to `<out_dir>/weights/v<version>` (HF safetensors + config.json) and update every server."""
        path = self.weights_root / f"v{version}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors")
        shutil.copy(self.hf_config, tmp / "config.json")
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        for worker in self.workers:
            worker.update_weights(path, version)
        for old in self.weights_root.iterdir():
            if old != path:
                shutil.rmtree(old)

    def versions(self) -> list[int]:
        return [w.version() for w in self.workers]
