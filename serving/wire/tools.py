"""An agent's tool list as vLLM's chat endpoint hands it to the chat template, so a compaction renders the agent's
prompts token for token (`compaction.render.render_history`) and reads what its turns left in the prefix cache.

vLLM validates each tool as a `ChatCompletionToolsParam` and passes `model_dump()` to the template: a function's
name, description and parameters (null when absent) in that order, `strict` and `defer_loading` only when set,
and nothing else. A template writes the list out as JSON, so field order and nulls change the tokens.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MAX_TOOLS = 1024


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ToolSpec(BaseModel):
    """A chat completion's function tool (`tools[i]`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    type: Literal["function"] = "function"
    function: FunctionSpec
    defer_loading: bool | None = None

    def engine_form(self) -> dict[str, Any]:
        """The dict vLLM's chat endpoint renders for this tool."""
        function = self.function.model_dump(exclude={"strict", "defer_loading"})
        defer = self.function.defer_loading if self.function.defer_loading is not None else self.defer_loading
        function |= {k: v for k, v in (("strict", self.function.strict), ("defer_loading", defer)) if v is not None}
        return {"type": "function", "function": function} | (
            {"defer_loading": self.defer_loading} if self.defer_loading is not None else {}
        )


_TOOLS = TypeAdapter(list[ToolSpec])


def engine_tools(tools: Any) -> list[dict[str, Any]] | None:
    """`tools` (a chat body's, unvalidated) in the engine's form; None when there are none, or when the list is
    not one the engine accepts (it refuses the turn itself, naming the field)."""
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        return None
    try:
        return [tool.engine_form() for tool in _TOOLS.validate_python(tools)]
    except ValidationError:
        return None
