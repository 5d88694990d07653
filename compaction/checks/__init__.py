"""Stage 5: the checks every chunk summary passes before it is merged.

- `validity`: the history a compaction accepts and the messages it returns (tool calls answered, turns whole).
- `quality`: empty, runaway and repeated output; sentences that restate the prompt's instructions.
- `grounding`: salient tokens (names, numbers, paths, flags) a summary states that its source does not.
- `sources`: what each chunk's summary may state, built in one pass over the history.
- `settle`: a chunk's attempts -> the text that is kept (retry, strip, fall back to extractive or verbatim).
"""
