"""Serving: an OpenAI-compatible HTTP server over a continuously batched engine, a chat page at `/`,
and `kiln chat` in the terminal. See docs/serve.md."""
