"""The request router of the model and coordinator deployments, on Ray Serve's non-public router API.

Apart from `serving.ray_adapter` (ray.serve.llm's ingress pieces): a handle's router runs in the caller's
process, and the coordinators, which route their chunk prompts with it, import neither ray.serve.llm nor vLLM.
"""

from __future__ import annotations

import itertools
from typing import Any

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from serving.routing import RouteKey, order_replicas

ROUTER_CLASS = "serving.ray_router:SessionRouter"


class SessionRouter(ConsistentHashRouter):
    """Session affinity for agent turns, and the coordinator's placement keys.

    - a plain session id (the `x-session-id` of an agent's turn): the session's home replica, then
      its ring successors (exactly ConsistentHashRouter);
    - a `RouteKey` (`pc1:...`, sent by the compaction coordinator): the session's ring walk rotated
      to the key's slot, replicas that already failed the prompt last;
    - no session id: round robin over the running replicas.

    Every process builds the same ring from the same replica set, so the ingress (agent turns)
    and the coordinator (compaction prompts) agree on each session's home without talking.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._round_robin = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        session_id = pending_request.metadata.session_id
        key = RouteKey.decode(session_id)
        if key is None and session_id:
            return await super().choose_replicas(candidate_replicas, pending_request)
        pending_request.routing_context.should_backoff = True
        by_id = {replica_id.unique_id: replica for replica_id, replica in self._replicas.items()}
        if key is None or key.session is None:
            walk = sorted(by_id)
            key = RouteKey(None, next(self._round_robin), key.avoid if key else ())
        else:
            walk = [replica_id.unique_id for replica_id in self._lookup_ranked_replicas(key.session)]
        return [[by_id[r]] for r in order_replicas(walk, key) if r in by_id]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Hand the replica to exactly the request it was chosen for.

        The base class matches by internal request id, which all calls made while serving one
        request share (the coordinator's chunk prompts of one compaction): with several of them
        pending, only one would ever be matched and the others would wait forever. Match the
        request's own metadata object instead.
        """
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                if self._pending_requests_by_id.get(request_metadata.internal_request_id) is pending:
                    self._remove_pending_request_from_indices(pending)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)


def router_kwargs() -> dict[str, Any]:
    """Walk the whole ring: a session falls back to any replica when its home is busy or gone."""
    return {"num_fallback_replicas": 1024}
