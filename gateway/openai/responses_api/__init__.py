"""POST /v1/responses, OpenAI's Responses API, served by the chat path: `protocol` reads a request
into a ChatCompletionRequest, `serving` turns the chat replies into Response objects and events."""
