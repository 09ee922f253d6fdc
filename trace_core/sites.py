"""FP4 sites and routes: the one definition of what a site is and which token positions carry a route.

A site is `(layer, kind)`: `layer` the 0-based decoder layer (Megatron's `layer_number - 1`, the HF / SGLang layer
index) and `kind` one of `SITE_KINDS` — the routed experts' input (`moe_in`), the attention keys (`k`) and values
(`v`). These are the sites whose rounding outcomes the rollout can record (docs/design.md, "Sites").
"""

from __future__ import annotations

import torch

SITE_KINDS = ("moe_in", "k", "v")

Site = tuple[int, str]


def check_site(site: Site) -> Site:
    """Return `site` if it is `(layer >= 0, kind in SITE_KINDS)`, else raise ValueError naming it."""
    ok = isinstance(site, tuple) and len(site) == 2
    if ok:
        layer, kind = site
        ok = not isinstance(layer, bool) and isinstance(layer, int) and layer >= 0 and kind in SITE_KINDS
    if not ok:
        raise ValueError(f"site must be (layer >= 0, kind in {SITE_KINDS}), got {site!r}")
    return site


def routed(position: torch.Tensor, length: torch.Tensor | int) -> torch.Tensor:
    """Whether the token at `position` of a trajectory of `length` tokens has a rollout route (broadcasting).

    Every position but the last: the rollout never runs the router on a trajectory's final token (it generates no
    successor, and an SGLang server never feeds it back), and under causal attention nothing depends on it. The
    trainer replays no route there (R3 gives it placeholder experts) and does not ask the store for one.
    """
    return position < torch.as_tensor(length) - 1
