"""The OpenAI-compatible HTTP front end (FastAPI), in vLLM's rooms: `api_server` (the app, routes
and error handlers), `protocol` / `responses` (request and reply models), `serving_chat` and
`serving_completion` (one endpoint each), `tool_parsers/` (one class per tool-call format), and
the pieces they use (middleware, structured outputs, prompt logprobs, LoRA routes...)."""
