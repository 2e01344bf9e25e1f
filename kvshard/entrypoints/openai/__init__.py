"""The OpenAI-compatible HTTP API, by concern (as vLLM lays it out): protocol (request models, errors),
serving_engine (what every generation route shares), serving_completion, serving_chat, serving_responses,
serving_tokenization, tool_parsers, door (what reaches a route at all) and api_server (the app, its routes)."""
