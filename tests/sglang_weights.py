"""SGLang 0.5.15's receiving side of the weight-update endpoints, for HTTP stand-ins (`tests/rl_stand_in.py`,
`tests/sglang_weights_cpu.py`): each body parsed as SGLang's FastAPI route parses it (`parse_request`), then what its
tokenizer manager, `TpModelWorker` and `ModelRunner` do with it (`WeightReceiver`), SGLang's own functions called on
a runner object whose model is the stand-in's."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace

import msgspec
import pydantic
import torch
from sglang.srt.managers import io_struct

REQUESTS = {  # the route's body type (sglang.srt.managers.io_struct)
    "/update_weights_from_tensor": io_struct.UpdateWeightsFromTensorReqInput,
    "/init_weights_update_group": io_struct.InitWeightsUpdateGroupReqInput,
    "/update_weights_from_distributed": io_struct.UpdateWeightsFromDistributedReqInput,
    "/destroy_weights_update_group": io_struct.DestroyWeightsUpdateGroupReqInput,
}


def parse_request(endpoint: str, raw: bytes):
    """The body of `endpoint` as SGLang's FastAPI route parses it (pydantic over the io_struct class: base64 decoded,
    defaults filled). SGLang ignores a field it does not know; the stand-in refuses it (ValueError), so a misspelt
    field cannot pass the tests unnoticed."""
    cls = REQUESTS[endpoint]
    known = {f.name for f in msgspec.structs.fields(cls)}
    unknown = sorted(set(json.loads(raw)) - known)
    if unknown:
        raise ValueError(f"{endpoint}: fields {unknown} are not fields of {cls.__name__} (SGLang would drop them)")
    return pydantic.TypeAdapter(cls).validate_json(raw)


class WeightReceiver:
    """SGLang 0.5.15's receiving side of the weight-update endpoints for a TP = 1 server, through its own code:
    `parse_request`, then the tokenizer manager's payload normalization, `TpModelWorker`'s deserialization and
    `ModelRunner`'s methods, called on a runner whose `model.load_weights` is `load` (a list of (name, tensor))."""

    def __init__(self, load: Callable[[list[tuple[str, torch.Tensor]]], None]):
        """`load`: the runner's `model.load_weights` (SGLang's model's own, or a stand-in's)."""
        self.runner = SimpleNamespace(
            tp_rank=0,
            device="cpu",
            _model_update_group={},
            model=SimpleNamespace(load_weights=load),
            server_args=SimpleNamespace(custom_weight_loader=[]),
        )
        self.requests: list[tuple[str, object]] = []  # (endpoint, parsed request), in arrival order

    def handle(self, endpoint: str, raw: bytes) -> tuple[bool, str, object]:
        """(success, message, request) of one call, as the route would answer it."""
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        req = parse_request(endpoint, raw)
        self.requests.append((endpoint, req))
        r = self.runner
        if endpoint == "/init_weights_update_group":
            ok, msg = ModelRunner.init_weights_update_group(
                r, req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend
            )
        elif endpoint == "/update_weights_from_distributed":
            ok, msg = ModelRunner.update_weights_from_distributed(
                r, req.names, req.dtypes, req.shapes, req.group_name, req.load_format
            )
        elif endpoint == "/destroy_weights_update_group":
            ok, msg = ModelRunner.destroy_weights_update_group(r, req.group_name)
        else:  # tensor: the tokenizer manager normalizes, the TP worker deserializes its rank's entry
            req.serialized_named_tensors = normalize_serialized_named_tensor_payloads(req.serialized_named_tensors)
            monkey_patch_torch_reductions()
            named = MultiprocessingSerializer.deserialize(req.serialized_named_tensors[r.tp_rank])
            try:
                ok, msg = ModelRunner.update_weights_from_tensor(r, named_tensors=named, load_format=req.load_format)
            except Exception as e:  # SGLang's scheduler would log it; the route answers the failure here
                ok, msg = False, f"Failed to update weights from tensor: {type(e).__name__}: {e}"
        return ok, msg, req
