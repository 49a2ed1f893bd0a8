"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}), as a translation over the same
request flow chat completions use: protocol.py reads the body into chat messages, sampling fields and a tool
request; outputs.py shapes the text events into a Response object or the Responses event stream; store.py keeps
responses (`store` defaults to true; bounded, with a TTL) for `previous_response_id` and GET; routes.py holds
the handlers. Errors keep OpenAI's shape (errors.py)."""
