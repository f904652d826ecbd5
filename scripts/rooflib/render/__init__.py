"""Rendering: the HTML and text report, and the templates of log entries."""
