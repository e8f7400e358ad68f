"""The chat page served at `/`: static HTML, JS and CSS that talk to the OpenAI-compatible API."""
