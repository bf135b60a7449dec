"""Summit's OpenAPI document (`GET /openapi.json`): what a client can send to Summit's HTTP entry.

The OpenAI routes are vLLM's own (their request schemas come from vLLM's app, so they describe exactly the bodies
vLLM validates); Summit adds its own routes (`/v1/files`, `/v1/batches`, `/health`) and the answers its front gives
(401 without a key, 429/503 when overloaded, every error in OpenAI's shape). Nothing here is served that vLLM's app
exposes but Summit does not route (vLLM's `/metrics`, `/load`, ...).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
_ERROR_WRAPPER = {  # what Summit answers on error: OpenAI's {"error": {...}}
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}


def _errors(*statuses: int) -> dict:
    why = {
        400: "Bad request",
        401: "Missing or wrong API key",
        404: "Unknown model, file or batch",
        405: "Wrong method",
        409: "Conflict",
        413: "Too large",
        429: "Overloaded or rate limited (Retry-After)",
        503: "No engine can take it now (Retry-After)",
    }
    return {str(s): {"description": why[s], "content": {"application/json": {"schema": ERROR}}} for s in statuses}


_OVERLOAD = (400, 401, 404, 429, 503)
_ID = {"name": "", "in": "path", "required": True, "schema": {"type": "string"}}
_OK = {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}}


def _id(name: str) -> dict:
    return {**_ID, "name": name}


BATCH_PATHS: dict[str, Any] = {
    "/v1/files": {
        "post": {
            "summary": "Upload a batch input file (JSONL)",
            "operationId": "upload_file",
            "requestBody": {
                "required": True,
                "content": {
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "required": ["file", "purpose"],
                            "properties": {
                                "file": {"type": "string", "format": "binary"},
                                "purpose": {"type": "string", "enum": ["batch"]},
                            },
                        }
                    }
                },
            },
            "responses": {**_OK, **_errors(400, 401, 413)},
        },
        "get": {
            "summary": "List files",
            "operationId": "list_files",
            "parameters": [
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
                {"name": "purpose", "in": "query", "schema": {"type": "string"}},
                {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
            ],
            "responses": {**_OK, **_errors(400, 401)},
        },
    },
    "/v1/files/{file_id}": {
        "get": {
            "summary": "A file",
            "operationId": "get_file",
            "parameters": [_id("file_id")],
            "responses": {**_OK, **_errors(401, 404)},
        },
        "delete": {
            "summary": "Delete a file",
            "operationId": "delete_file",
            "parameters": [_id("file_id")],
            "responses": {**_OK, **_errors(401, 404, 409)},
        },
    },
    "/v1/files/{file_id}/content": {
        "get": {
            "summary": "A file's bytes",
            "operationId": "file_content",
            "parameters": [_id("file_id")],
            "responses": {
                "200": {"description": "The file", "content": {"application/octet-stream": {}}},
                **_errors(401, 404),
            },
        }
    },
    "/v1/batches": {
        "post": {
            "summary": "Create a batch",
            "operationId": "create_batch",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["input_file_id", "endpoint", "completion_window"],
                            "properties": {
                                "input_file_id": {"type": "string"},
                                "endpoint": {"type": "string", "enum": ["/v1/completions", "/v1/chat/completions"]},
                                "completion_window": {"type": "string"},
                                "metadata": {
                                    "type": ["object", "null"],
                                    "maxProperties": 16,
                                    "additionalProperties": {"type": "string"},
                                },
                            },
                        }
                    }
                },
            },
            "responses": {**_OK, **_errors(400, 401, 404)},
        },
        "get": {
            "summary": "List batches",
            "operationId": "list_batches",
            "parameters": [
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
            ],
            "responses": {**_OK, **_errors(400, 401)},
        },
    },
    "/v1/batches/{batch_id}": {
        "get": {
            "summary": "A batch",
            "operationId": "get_batch",
            "parameters": [_id("batch_id")],
            "responses": {**_OK, **_errors(401, 404)},
        }
    },
    "/v1/batches/{batch_id}/cancel": {
        "post": {
            "summary": "Cancel a batch",
            "operationId": "cancel_batch",
            "parameters": [_id("batch_id")],
            "responses": {**_OK, **_errors(401, 404, 409)},
        }
    },
}

_TEXT_OK = {
    "200": {
        "description": "Done (plain text, as vLLM's server answers)",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}
# vLLM's adapter routes, where a model has `lora.runtime_loading` (deployments/lora/runtime.py); `model` is Summit's
LORA_PATHS: dict[str, Any] = {
    "/v1/load_lora_adapter": {
        "post": {
            "summary": "Load a LoRA adapter into a model's replicas",
            "operationId": "load_lora_adapter",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["lora_name", "lora_path"],
                            "properties": {
                                "lora_name": {"type": "string", "pattern": "^\\S+$"},
                                "lora_path": {"type": "string", "minLength": 1},
                                "model": {"type": "string", "description": "The base model, where several allow it"},
                            },
                        }
                    }
                },
            },
            "responses": {**_TEXT_OK, **_errors(400, 401, 404, 503)},
        }
    },
    "/v1/unload_lora_adapter": {
        "post": {
            "summary": "Unload an adapter loaded at run time",
            "operationId": "unload_lora_adapter",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["lora_name"],
                            "properties": {"lora_name": {"type": "string"}},
                        }
                    }
                },
            },
            "responses": {**_TEXT_OK, **_errors(400, 401, 404, 503)},
        }
    },
}

HEALTH = {
    "get": {
        "summary": "200 while this replica's engine lives, else 503",
        "operationId": "health",
        "security": [],
        "responses": {"200": {"description": "Healthy"}, "503": {"description": "Dead"}},
    }
}


def _refs(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            yield ref.rsplit("/", 1)[1]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


# vLLM's operations on a stored response (VLLM_ENABLE_RESPONSES_API_STORE; deployments/http/response_ids.py)
_STORED_RESPONSE_OPS = (("/v1/responses/{response_id}", "get"), ("/v1/responses/{response_id}/cancel", "post"))


def build(
    vllm_doc: dict, routes: Iterable[str], batch: bool, keys: bool, title: str = "Summit", runtime_lora: bool = False
) -> dict:
    """Summit's document from vLLM's (`app.openapi()`): vLLM's operations for `routes` (POST) and GET /v1/models,
    with the answers Summit gives, plus Summit's own routes (the Batch API's with `batch`, the adapter routes with
    `runtime_lora`); only the schemas those reference."""
    paths: dict[str, Any] = {"/health": HEALTH}
    for route in sorted(routes):
        if "post" not in vllm_doc["paths"].get(route, {}):
            continue  # not in this vLLM's app
        op = copy.deepcopy(vllm_doc["paths"][route]["post"])
        ok = op["responses"].get("200") or {"description": "OK"}
        op["responses"] = {"200": ok, **_errors(*_OVERLOAD)}
        paths[route] = {"post": op}
    for route, method in _STORED_RESPONSE_OPS:  # retrieve and cancel (answered where vLLM keeps responses)
        op = copy.deepcopy(vllm_doc["paths"].get(route, {}).get(method))
        if op is not None:
            op["responses"] = {"200": op["responses"].get("200") or {"description": "OK"}, **_errors(400, 401, 404)}
            paths.setdefault(route, {})[method] = op
    models = copy.deepcopy(vllm_doc["paths"].get("/v1/models", {}).get("get") or {"responses": _OK})
    models["responses"] = {**models["responses"], **_errors(401)}
    paths["/v1/models"] = {"get": models}
    if batch:
        paths.update(copy.deepcopy(BATCH_PATHS))
    if runtime_lora:
        paths.update(copy.deepcopy(LORA_PATHS))
    all_schemas = vllm_doc.get("components", {}).get("schemas", {})
    schemas: dict[str, Any] = {}
    todo = list(_refs(paths))
    while todo:
        name = todo.pop()
        if name in schemas or name not in all_schemas:
            continue
        schemas[name] = copy.deepcopy(all_schemas[name])
        todo.extend(_refs(schemas[name]))
    schemas.setdefault("ErrorResponse", _ERROR_WRAPPER)  # vLLM's has this shape (OpenAI's)
    doc = {
        "openapi": vllm_doc.get("openapi", "3.1.0"),
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if keys:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"apiKey": []}]
    return doc
