"""Quality: perplexity, tool-call checks, and accepting a candidate deployment."""
