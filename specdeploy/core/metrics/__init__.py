"""The metrics a deployment exports: names, sinks, the BLS's recorder, the endpoint's reader, the dashboard."""
