"""Anthropic's Messages API (POST /v1/messages) on the gateway's HTTP port: requests translated into
the chat path (gateway/openai/serving_chat.py), replies and event streams back in Anthropic's shape."""
