"""Experiment tracking: TensorBoard event files under the run directory (default) and Weights & Biases.

Every numeric metric of a step is logged under its TRACE name (docs/rl.md, Metrics); the quantities verl's
dashboards chart are logged under verl's names too (`VERL_NAMES`), so a verl dashboard finds reward, response
length and step time parts. The train/rollout mismatch metrics already carry slime's names
(`train_rollout_logprob_abs_diff`, ...).
"""

from __future__ import annotations

from pathlib import Path

LOGGERS = ("tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"

VERL_NAMES = {
    "reward/mean": "critic/score/mean",
    "rollout/response_len": "response_length/mean",
    "time/step_s": "timing_s/step",
    "time/rollout_s": "timing_s/gen",
    "time/train_s": "timing_s/update_actor",
    "time/sync_s": "timing_s/update_weights",
}


class Tracker:
    """Logs step metrics to the configured backends; `loggers` is a subset of `LOGGERS` (may be empty)."""

    def __init__(
        self,
        run_dir: str | Path,
        loggers: tuple[str, ...],
        *,
        config: dict,
        start_step: int = 0,
        wandb_project: str = "trace",
        wandb_run: str = "",
    ):
        bad = [name for name in loggers if name not in LOGGERS]
        if bad:
            raise ValueError(f"loggers {bad} are not among {LOGGERS}")
        self.writers = []
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run replaces the events an interrupted run wrote after its checkpoint
            self.writers.append(SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR), purge_step=start_step))
        self.wandb = None
        if "wandb" in loggers:
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=wandb_run or None, config=config, resume="allow")

    def log(self, metrics: dict, step: int) -> None:
        numeric = (k for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool))
        values = {k: float(metrics[k]) for k in numeric if k != "step"}
        values |= {VERL_NAMES[k]: v for k, v in values.items() if k in VERL_NAMES}
        for writer in self.writers:
            for name, value in values.items():
                writer.add_scalar(name, value, step)
            writer.flush()
        if self.wandb is not None and step < 0:  # W&B steps start at 0: a value before training (step -1) goes to
            self.wandb.summary.update({f"before_train/{k}": v for k, v in values.items()})  # the run's summary
        elif self.wandb is not None:
            self.wandb.log(values, step=step)

    def log_text(self, tag: str, rows: list[dict], text: str, step: int) -> None:
        """A text summary (`text`, markdown) to TensorBoard and the same `rows` as a W&B table."""
        for writer in self.writers:
            writer.add_text(tag, text, step)
            writer.flush()
        if self.wandb is not None and rows:
            import wandb

            columns = list(rows[0])
            self.wandb.log({tag: wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])}, step=step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        if self.wandb is not None:
            self.wandb.finish()
