"""The KV producer side of a simulated instance: the side channels a decoder pulls
the KV a prefill left here through (:mod:`pd_orchestrator.sim.handover`), per
connector: NIXL (pull and push), Mooncake (bootstrap query and pull), MoRIIO
(notify) and the offloading connector's P2P (fetch and lookup).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_orchestrator.sim.handover import Fetched
from pd_orchestrator.sim.instance import HTTPFailure, Instance, json_object

__all__ = ["SideChannels"]


class SideChannels:
    """The side-channel routes of one instance."""

    def __init__(self, sim: Instance) -> None:
        self.sim = sim

    def _speaks(self, name: str) -> None:
        if name not in self.sim.connectors:
            raise HTTPFailure(404, f"this instance does not speak the {name} connector")

    def _check_block_size(self, body: dict[str, Any]) -> None:
        if body.get("block_size") not in (None, self.sim.options.block_size):
            raise HTTPFailure(409, "block size mismatch")

    def _check_engine(self, body: dict[str, Any]) -> None:
        if body.get("remote_engine_id") != self.sim.engine_id:
            raise HTTPFailure(409, f"engine id mismatch: this is {self.sim.engine_id!r}")

    @staticmethod
    def _blocks(held: Fetched | None, what: str) -> Response:
        if held is None:
            raise HTTPFailure(404, f"no KV blocks held for {what}")
        hashes = [h.hex() for h in held.block_hashes]
        return JSONResponse({"block_hashes": hashes, "num_tokens": held.num_tokens})

    async def _claim(self, key: str) -> Fetched | None:
        held = await self.sim.runner.claim(key, self.sim.options.lease_seconds)
        return None if held is None else Fetched(held.block_hashes, held.num_tokens)

    async def nixl_pull(self, request: Request) -> Response:
        """The decoder READs blocks held for ``remote_request_id`` (they must be held)."""
        body = await json_object(request)
        self._check_engine(body)
        self._check_block_size(body)
        request_id = body.get("remote_request_id")
        held = self.sim.runner.release(f"nixl:{request_id}") if request_id else None
        fetched = None if held is None else Fetched(held.block_hashes, held.num_tokens)
        return self._blocks(fetched, f"request {request_id!r}")

    async def nixl_push(self, request: Request) -> Response:
        """A decoder registers its blocks for base ``request_id``; this instance writes."""
        self._speaks("nixl-push")
        body = await json_object(request)
        self._check_engine(body)
        self._check_block_size(body)
        request_id = body.get("request_id")
        return self._blocks(await self._claim(f"nixl-push:{request_id}"), f"{request_id!r}")

    async def mooncake_query(self, request: Request) -> Response:
        """Mooncake's bootstrap server: ``{dp_rank: {engine_id, worker_addr}}``."""
        self._speaks("mooncake")
        me = self.sim.advertised()
        worker = f"http://{me.host}:{me.port}"
        return JSONResponse({"0": {"engine_id": me.engine_id, "worker_addr": {"0": {"0": worker}}}})

    async def mooncake_pull(self, request: Request) -> Response:
        self._speaks("mooncake")
        body = await json_object(request)
        self._check_block_size(body)
        transfer_id = body.get("transfer_id")
        return self._blocks(await self._claim(f"mooncake:{transfer_id}"), f"{transfer_id!r}")

    async def moriio_notify(self, request: Request) -> Response:
        """A decoder's "blocks ready" notice; this instance writes once it holds the KV."""
        self._speaks("moriio")
        body = await json_object(request)
        self._check_block_size(body)
        transfer_id = body.get("transfer_id")
        return self._blocks(await self._claim(f"moriio:{transfer_id}"), f"{transfer_id!r}")

    async def p2p_fetch(self, request: Request) -> Response:
        self._speaks("offloading")
        body = await json_object(request)
        self._check_block_size(body)
        kv_request_id = body.get("kv_request_id")
        held = await self._claim(f"offloading:{kv_request_id}")
        return self._blocks(held, f"{kv_request_id!r}")

    async def p2p_lookup(self, request: Request) -> Response:
        """Which leading blocks of a prompt this instance's prefix cache holds."""
        self._speaks("offloading")
        body = await json_object(request)
        self._check_block_size(body)
        try:
            hashes = [bytes.fromhex(h) for h in body.get("block_hashes") or []]
        except (TypeError, ValueError):
            raise HTTPFailure(400, "block_hashes: a list of hex strings is required") from None
        size = self.sim.options.block_size
        tokens = self.sim.engine.local_hit_tokens_of(hashes, len(hashes) * size + 1)
        return self._blocks(Fetched(tuple(hashes[: tokens // size]), tokens), "lookup")
