"""ray.serve.llm's node initialisation, skipped where it has nothing to do.

Before it starts an engine, each LLMServer replica runs one Ray task per node of its placement group to download
the weights there. For weights that are already a folder on the replica's own node (the CPU default, a local
checkpoint) the task finds them and returns their path, but it starts a fresh worker that imports vLLM to do so:
about 14 s of a CPU core per replica start, on a 2-core machine a fifth of the start. `LocalWeights` skips it when
the folder is on this node and the whole placement group is too; anything else (a hub id, a bucket, bundles on
other nodes) is initialised as before.
"""

from __future__ import annotations

from pathlib import Path

import ray
from ray.llm._internal.common.callbacks.base import CallbackBase  # the hook LLMConfig.callback_config names


class LocalWeights(CallbackBase):
    async def on_before_node_init(self) -> None:
        engine = self.llm_config.get_engine_config()
        if engine is None or not Path(engine.actual_hf_model_id).is_dir():
            return
        here = ray.get_runtime_context().get_node_id()
        group = self.ctx.placement_group
        nodes = set(ray.util.placement_group_table(group)["bundles_to_node_id"].values()) if group else {here}
        self.ctx.run_init_node = not nodes <= {here}
