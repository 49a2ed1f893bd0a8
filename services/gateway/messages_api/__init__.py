"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as a translation over the same
request flow chat completions use: protocol.py reads Anthropic's body into chat messages, sampling fields and a
tool request; outputs.py shapes the text events into a message or Anthropic's stream events; errors.py renders
failures in Anthropic's error shape and status codes; routes.py holds the handlers."""
