"""The OpenAI-compatible HTTP API (FastAPI): routes, error handlers, middleware wiring."""

from __future__ import annotations

import inspect

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import metrics
from gateway.admin_routes import add_admin_routes
from gateway.anthropic.routes import add_anthropic_routes
from gateway.errors import GatewayError, UpstreamError, error_body, to_client_error
from gateway.openai.json_body import IJSONRoute
from gateway.openai.lora_routes import add_lora_routes
from gateway.openai.middleware import (
    BodySizeLimitMiddleware,
    ClientErrorLogMiddleware,
    RequestCounterMiddleware,
    TenancyMiddleware,
)
from gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from gateway.openai.responses_api.protocol import ResponsesRequest
from gateway.openai.responses_api.serving import create_response
from gateway.openai.serving_chat import ToolPlan, chat_prompt_ids, create_chat_completion, tool_parser_class
from gateway.openai.serving_completion import create_completion
from gateway.openai.serving_embedding import EmbeddingRequest, create_embedding
from gateway.openai.session_routes import add_session_routes
from gateway.state import GatewayState
from gateway.tenancy.rate_limit import retry_after_header
from gateway.tokenizer import Tokenizer
from gateway.web.chat_page import add_chat_page
from pagoda.contract.errors import InvalidRequestError
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)
VERSION = "0.1.0"


def error_response(error: BaseException, retry_after_s: int = 1, path: str = "") -> JSONResponse:
    client_error = to_client_error(error)
    if client_error.http_status >= 500:
        log.warning("request_failed", status=client_error.http_status, error=str(error),
                    error_type=type(error).__name__)
    retry_after = (retry_after_header(client_error.retry_after_s) if client_error.retry_after_s is not None
                   else str(retry_after_s))
    headers = {"Retry-After": retry_after} if client_error.http_status in (429, 503) else None
    return JSONResponse(error_body(path, client_error.http_status, client_error.message, client_error.param),
                        status_code=client_error.http_status, headers=headers)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":  # loc is ("body", character offset), not a field
        offset = first.get("loc", ("body", 0))[-1]
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        return f"the body could not be read as JSON: {reason} (at character {offset})", None
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    return (f"{param}: {first.get('msg', 'invalid request')}" if param
            else str(first.get("msg", "invalid request"))), param


# Recent FastAPI versions trace every request (health probes too) once a tracer provider is set.
# The gateway's one span per request is its own GenAI span (generation.py): switch FastAPI's off.
_NO_NATIVE_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                        if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def create_app(state: GatewayState) -> FastAPI:
    app = FastAPI(title="Pagoda gateway", version=VERSION, **_NO_NATIVE_TELEMETRY)
    app.state.gateway = state
    app.router.route_class = IJSONRoute  # bodies read as I-JSON: a lone surrogate is a 400
    _add_routes(app, state)
    add_lora_routes(app, state)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    add_session_routes(app, state)  # DELETE /v1/sessions/{id}
    add_admin_routes(app, state)  # POST /admin/migrate, /admin/drain: live migration
    add_anthropic_routes(app, state)  # /v1/messages: Anthropic's Messages API
    add_chat_page(app)  # GET /: the chat page (gateway/web/static/), outside the OpenAPI schema
    _add_error_handlers(app, state.config.retry_after_s)
    routes = frozenset(route.path for route in app.routes)
    # Outermost first at run time: the 4xx log, count, then auth, then the size cap.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=state.config.max_request_bytes)
    app.add_middleware(TenancyMiddleware, tenancy=state.tenancy)
    app.add_middleware(RequestCounterMiddleware, routes=routes)
    app.add_middleware(ClientErrorLogMiddleware)
    return app


def _add_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)  # 400, not FastAPI's 422 (as vLLM)
        return JSONResponse(error_body(request.url.path, 400, message, param), status_code=400)

    # FastAPI's own refusals (a body that is not JSON, 404 for an unknown path, 405): the same
    # OpenAI error shape as every other 4xx, with FastAPI's status code and message.
    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = error.detail if isinstance(error.detail, str) else "invalid request"
        return JSONResponse(error_body(request.url.path, error.status_code, message), status_code=error.status_code,
                            headers=error.headers)

    async def on_error(request: Request, error: Exception) -> JSONResponse:
        return error_response(error, retry_after_s, request.url.path)

    # The specific classes are handled in ExceptionMiddleware; Exception (anything unexpected) by
    # Starlette's outermost handler, which also logs the traceback.
    for error_class in (GatewayError, InvalidRequestError, Exception):
        app.add_exception_handler(error_class, on_error)


def _chat_tokens(body: TokenizeRequest, tokenizer: Tokenizer, state: GatewayState) -> list[int]:
    """The prompt /v1/chat/completions would send for these messages. Tools are listed as the
    template lists them whatever tool_choice would be: tokenizing calls nothing (as vLLM)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.continue_final_message:  # the last (assistant) message left open for the model to go on
        kwargs["continue_final_message"] = True
    chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                                 chat_template_kwargs=kwargs)
    parser = tool_parser_class(state.config, tokenizer)
    tokens = chat_prompt_ids(chat, tokenizer, ToolPlan(parser, body.tools or None))
    if body.add_special_tokens:  # vLLM's opt-in: the tokenizer's specials (BOS) again in front of the
        # template's. What it adds to empty text is its prefix: the Llama family adds only a prefix.
        tokens = tokenizer.encode("", add_special_tokens=True) + tokens
    return tokens


def _add_routes(app: FastAPI, state: GatewayState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, state)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(body, request, state)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
        return await create_embedding(body, request, state)

    @app.get("/v1/models")
    async def models() -> dict:
        if not state.ready:
            state.require_ready()  # 503, as before any scheduler answered
        return {"object": "list", "data": state.pools.cards()}  # every model pool's

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        tokenizer, info = state.pool(body.model).require_ready()
        if body.messages is not None:
            tokens = _chat_tokens(body, tokenizer, state)
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        # vLLM's TokenizeResponse: token_strs is null unless asked for
        return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens,
                "token_strs": tokenizer.hf.convert_ids_to_tokens(tokens) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        tokenizer, info = state.pool(body.model).require_ready()
        if info.vocab_size and any(not 0 <= t < info.vocab_size for t in body.tokens):
            raise InvalidRequestError(f"token ids must be in [0, {info.vocab_size})")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)  # alive: the process answers; /ready says if it can serve

    @app.get("/ready")
    async def ready() -> Response:
        serving = state.ready and await state.pools.is_serving()
        return JSONResponse({"ready": serving}, status_code=200 if serving else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        async def fetch_stats():  # None: the scheduler did not answer (then pagoda:engine_up 0)
            if len(state.pools.pools) > 1:
                return await state.pools.stats()  # {model: stats or None}: series per model pool
            try:
                return await state.client.get_stats()
            except UpstreamError:
                return None

        return Response(await metrics.METRICS.scrape(fetch_stats), media_type=metrics.CONTENT_TYPE_LATEST)
