"""Locust load tests of a running cluster against TTFT / ITL SLOs (see README)."""
