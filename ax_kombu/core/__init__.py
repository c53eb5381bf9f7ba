"""Pure logic, no I/O: statuses and transitions, snowflake ids, backoff, the timing wheel.

Everything here takes its clock (or random source) as an argument, so it is
tested without sleeping.
"""
