"""Wire formats: the OpenAI Responses and Anthropic Messages APIs, translated to and from the one chat path.

Pure modules (no Ray, no HTTP framework state): each turns a request of its format into a chat
completion body (compaction entry included) and the chat answer, whole or streamed, back into its
format. The ingress (`serving.api`) runs the chat path between the two halves. `compact` is our own
`POST /v1/compact` body; `codec` holds the compaction item both formats carry; `sse` reads the chat
stream and writes server-sent events.
"""
