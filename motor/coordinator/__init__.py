"""The gateway: OpenAI API in, routed to engine instances, answers streamed back."""
