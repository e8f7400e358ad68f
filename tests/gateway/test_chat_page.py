"""The chat page at `/` (gateway/web/): its HTML names the elements the script drives, its assets
come with their content types, it is served without an API key while the API still needs one, and
it stays out of the OpenAPI schema."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from html.parser import HTMLParser

import pytest

from gateway.web.chat_page import PAGE_FILES, STATIC

# The ids chat.js looks up with $("..."): a renamed element would leave the page dead.
SCRIPT_IDS = {"model", "api-key", "system", "temperature", "top_p", "max_tokens", "temperature-value",
              "top_p-value", "max_tokens-value", "clear", "status", "messages", "composer", "input", "send",
              "stop"}


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[str, str] = {}  # id -> tag
        self.label_for: set[str] = set()
        self.assets: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids[attrs["id"]] = tag
        if tag == "label" and "for" in attrs:
            self.label_for.add(attrs["for"])
        if tag == "script" and "src" in attrs:
            self.assets.append(attrs["src"])
        if tag == "link" and attrs.get("rel") == "stylesheet":
            self.assets.append(attrs["href"])


async def test_the_page_names_what_its_script_drives_and_its_assets_load(gateway):
    page = await gateway.http.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    elements = _Elements()
    elements.feed(page.text)
    assert SCRIPT_IDS <= set(elements.ids), SCRIPT_IDS - set(elements.ids)
    assert (elements.ids["model"], elements.ids["input"], elements.ids["send"]) == ("select", "textarea", "button")
    # Every form control has a label (screen readers name it).
    controls = {i for i, tag in elements.ids.items() if tag in ("select", "input", "textarea")}
    assert controls <= elements.label_for, controls - elements.label_for

    assert sorted(elements.assets) == ["/static/chat.css", "/static/chat.js"]
    for asset, kind in (("/static/chat.js", "text/javascript"), ("/static/chat.css", "text/css")):
        response = await gateway.http.get(asset)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
        assert response.content == (STATIC / PAGE_FILES[asset][0]).read_bytes()
    script = (await gateway.http.get("/static/chat.js")).text
    for element_id in SCRIPT_IDS:
        assert f'$("{element_id}")' in script or '$(name + "-value")' in script, element_id
    assert "/v1/chat/completions" in script and "/v1/models" in script and "[DONE]" in script


async def test_only_the_listed_files_are_served(gateway):
    for path in ("/static/", "/static/../chat_page.py", "/static/index.html", "/index.html"):
        response = await gateway.http.get(path)
        assert response.status_code == 404, path
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", list(PAGE_FILES))
async def test_the_page_is_served_without_a_key_but_the_api_wants_one(make_gateway, path):
    gateway = await make_gateway(api_key="sekret")
    assert (await gateway.http.get(path)).status_code == 200
    assert (await gateway.http.get("/v1/models")).status_code == 401
    keyed = await gateway.http.get("/v1/models", headers={"Authorization": "Bearer sekret"})
    assert keyed.status_code == 200


async def test_the_page_is_not_in_the_openapi_schema(gateway):
    schema = (await gateway.http.get("/openapi.json")).json()
    assert not set(PAGE_FILES) & set(schema["paths"])
    assert "/v1/chat/completions" in schema["paths"]


def test_an_installed_package_carries_the_page():
    """Every file under static/ matches pyproject's package-data for gateway.web (else a wheel
    install would serve a 500 for it)."""
    pyproject = tomllib.loads((STATIC.parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["gateway.web"]
    files = [path.relative_to(STATIC.parent) for path in STATIC.rglob("*") if path.is_file()]
    assert {name for name, _ in PAGE_FILES.values()} <= {path.name for path in files}
    for path in files:
        assert any(fnmatch(str(path), pattern) for pattern in patterns), path
