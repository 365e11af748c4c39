//! Super-block weight types (q4k, q5k, q6k): work in progress, see issue 10.
