/* Exercises the C ABI (include/colibri.h) on the demo model and prints what
 * it got, for tests/c/check.py to compare with the Python API's answers.
 * Checks here what needs no Python: error codes and messages for bad input,
 * and that two threads generating on one handle get the same tokens.
 *
 *   capi_check DEMO.colibri CORRUPT.colibri ID...
 *
 * Output lines: "logits T V" then T*V hex floats, "greedy ...", "sampled ...",
 * "stream ...", "eos ...", "default ...", "stopped ...". Exit status 1 on a failed check. */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

static int failures = 0;

#define CHECK(cond, ...)                                                                 \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "capi_check: FAILED at line %d: ", __LINE__);                \
            fprintf(stderr, __VA_ARGS__);                                                \
            fprintf(stderr, "\n");                                                       \
            failures++;                                                                  \
        }                                                                                \
    } while (0)

static void expect_status(colibri_status got, colibri_status want, const char *what, const char *needle)
{
    const char *msg = colibri_last_error();
    CHECK(got == want, "%s: status %d, expected %d (%s)", what, (int)got, (int)want, msg);
    CHECK(msg != NULL && strstr(msg, needle) != NULL, "%s: message \"%s\" lacks \"%s\"", what, msg, needle);
}

static void print_ids(const char *tag, const uint32_t *ids, size_t n)
{
    printf("%s", tag);
    for (size_t i = 0; i < n; i++)
        printf(" %u", ids[i]);
    printf("\n");
}

struct stream_state {
    uint32_t ids[64];
    size_t n, stop_after;
};

static int on_token(uint32_t token, void *user)
{
    struct stream_state *s = user;
    s->ids[s->n++] = token;
    return s->n >= s->stop_after; /* nonzero stops */
}

struct job {
    const colibri_model *m;
    const uint32_t *prompt;
    size_t n_prompt;
    uint32_t out[32];
    size_t n_out;
    colibri_status status;
};

static void *generate_job(void *arg)
{
    struct job *j = arg;
    colibri_sampling s;
    colibri_sampling_default(&s);
    s.max_new_tokens = 24;
    s.ignore_eos = 1;
    j->status = colibri_generate(j->m, j->prompt, j->n_prompt, &s, j->out, 32, &j->n_out);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s DEMO.colibri CORRUPT.colibri ID...\n", argv[0]);
        return 2;
    }
    size_t n = (size_t)(argc - 3);
    uint32_t *ids = calloc(n, sizeof *ids);
    for (size_t i = 0; i < n; i++)
        ids[i] = (uint32_t)strtoul(argv[3 + i], NULL, 10);

    colibri_model *m = (colibri_model *)&failures; /* must be reset to NULL on failure */
    expect_status(colibri_init_model(NULL, NULL, &m), COLIBRI_STATUS_INVALID_INPUT, "NULL path", "path is NULL");
    CHECK(m == NULL, "a failed open left a non-NULL handle");
    expect_status(colibri_init_model(argv[2], NULL, &m), COLIBRI_STATUS_FORMAT, "corrupt file", argv[2]);
    expect_status(colibri_init_model("/no/such/model.colibri", NULL, &m), COLIBRI_STATUS_NOT_FOUND,
                  "missing file", "/no/such/model.colibri");
    colibri_options bad_opts = {0};
    expect_status(colibri_init_model(argv[1], &bad_opts, &m), COLIBRI_STATUS_INVALID_INPUT, "zeroed options",
                  "struct_size");

    colibri_options opts;
    colibri_options_default(&opts);
    opts.threads = 2;
    colibri_status st = colibri_init_model(argv[1], &opts, &m);
    if (st != COLIBRI_STATUS_OK) {
        fprintf(stderr, "capi_check: cannot open %s: %s\n", argv[1], colibri_last_error());
        return 1;
    }
    size_t vocab = colibri_vocab_size(m);
    CHECK(vocab > 0 && colibri_context_length(m) > n, "vocab %zu, context %zu", vocab,
          colibri_context_length(m));

    float *logits = malloc(n * vocab * sizeof *logits);
    st = colibri_forward(m, ids, n, logits);
    CHECK(st == COLIBRI_STATUS_OK, "forward: %s", colibri_last_error());
    printf("logits %zu %zu\n", n, vocab);
    for (size_t i = 0; i < n * vocab; i++)
        printf("%a\n", logits[i]);

    uint32_t out[64];
    size_t n_out = 0;
    colibri_sampling s;
    colibri_sampling_default(&s);
    s.max_new_tokens = 24;
    s.ignore_eos = 1;
    st = colibri_generate(m, ids, n, &s, out, 64, &n_out);
    CHECK(st == COLIBRI_STATUS_OK && n_out == 24, "greedy: %d, %zu tokens: %s", (int)st, n_out,
          colibri_last_error());
    print_ids("greedy", out, n_out);
    uint32_t greedy[64];
    memcpy(greedy, out, sizeof out);

    s.temperature = 0.8f;
    s.top_p = 0.95f;
    s.seed = 1234;
    st = colibri_generate(m, ids, n, &s, out, 64, &n_out);
    CHECK(st == COLIBRI_STATUS_OK, "sampled: %s", colibri_last_error());
    print_ids("sampled", out, n_out);

    struct stream_state ss = {.n = 0, .stop_after = 5};
    colibri_sampling_default(&s);
    s.max_new_tokens = 24;
    s.ignore_eos = 1;
    st = colibri_generate_stream(m, ids, n, &s, on_token, &ss, &n_out);
    CHECK(st == COLIBRI_STATUS_OK && n_out == 5 && ss.n == 5, "stream stopped after %zu/%zu: %s", n_out, ss.n,
          colibri_last_error());
    CHECK(memcmp(ss.ids, greedy, 5 * sizeof(uint32_t)) == 0, "streamed tokens differ from generate's");
    print_ids("stream", ss.ids, ss.n);

    uint32_t eos[16];
    size_t n_eos = colibri_eos_ids(m, eos, 16);
    print_ids("eos", eos, n_eos < 16 ? n_eos : 16);
    colibri_sampling_default(&s); /* stops on the model's end-of-sequence ids */
    s.max_new_tokens = 48;
    st = colibri_generate(m, ids, n, &s, out, 64, &n_out);
    CHECK(st == COLIBRI_STATUS_OK, "default: %s", colibri_last_error());
    print_ids("default", out, n_out);

    /* An extra stop id: the output ends at its first occurrence, kept. */
    colibri_sampling_default(&s);
    s.max_new_tokens = 24;
    s.ignore_eos = 1;
    s.stop_ids = &greedy[10];
    s.n_stop_ids = 1;
    st = colibri_generate(m, ids, n, &s, out, 64, &n_out);
    CHECK(st == COLIBRI_STATUS_OK && n_out <= 11 && out[n_out - 1] == greedy[10], "stop id: %s",
          colibri_last_error());
    print_ids("stopped", out, n_out);

    /* A constraint: the output is three digits (on a model with a tokenizer). */
    colibri_sampling_default(&s);
    s.max_new_tokens = 12;
    s.regex = "[0-9]{3}";
    st = colibri_generate(m, ids, n, &s, out, 64, &n_out);
    if (st == COLIBRI_STATUS_OK)
        print_ids("regex", out, n_out);
    else
        CHECK(st == COLIBRI_STATUS_INVALID_INPUT && strstr(colibri_last_error(), "tokenizer") != NULL,
              "regex: %s", colibri_last_error());
    s.regex = "(";
    st = colibri_generate(m, ids, n, &s, out, 64, &n_out);
    CHECK(st == COLIBRI_STATUS_INVALID_INPUT, "a regex that cannot compile: status %d", (int)st);
    s.regex = "[0-9]";
    s.grammar = "start: \"a\"";
    st = colibri_generate(m, ids, n, &s, out, 64, &n_out);
    CHECK(st == COLIBRI_STATUS_INVALID_INPUT && strstr(colibri_last_error(), "at most one") != NULL,
          "two constraints: %s", colibri_last_error());
    /* A caller built before the constraint fields passes a shorter struct:
       what lies past its size is not read. */
    colibri_sampling_default(&s);
    s.struct_size = (uint32_t)offsetof(colibri_sampling, json_schema);
    s.max_new_tokens = 4;
    s.ignore_eos = 1;
    s.regex = "(";
    st = colibri_generate(m, ids, n, &s, out, 64, &n_out);
    CHECK(st == COLIBRI_STATUS_OK && n_out == 4 && memcmp(out, greedy, 4 * sizeof(uint32_t)) == 0,
          "an older struct: %s", colibri_last_error());

    /* Speculative decoding: n-gram drafts give the greedy output; drafts
       from a multi-token-prediction layer the file lacks are refused. */
    colibri_sampling_default(&s);
    s.max_new_tokens = 24;
    s.ignore_eos = 1;
    s.speculative = 1;
    s.draft_tokens = 4;
    st = colibri_generate(m, ids, n, &s, out, 64, &n_out);
    CHECK(st == COLIBRI_STATUS_OK && n_out == 24 && memcmp(out, greedy, 24 * sizeof(uint32_t)) == 0,
          "speculative ngram: %s", colibri_last_error());
    ss.n = 0;
    ss.stop_after = 5;
    st = colibri_generate_stream(m, ids, n, &s, on_token, &ss, &n_out);
    CHECK(st == COLIBRI_STATUS_OK && n_out == 5 && memcmp(ss.ids, greedy, 5 * sizeof(uint32_t)) == 0,
          "speculative stream: %s", colibri_last_error());
    s.speculative = 2;
    st = colibri_generate(m, ids, n, &s, out, 64, &n_out);
    if (st != COLIBRI_STATUS_OK)
        CHECK(st == COLIBRI_STATUS_INVALID_INPUT && strstr(colibri_last_error(), "multi-token") != NULL,
              "speculative mtp: %s", colibri_last_error());
    else
        CHECK(n_out == 24 && memcmp(out, greedy, 24 * sizeof(uint32_t)) == 0, "speculative mtp output differs");
    s.speculative = 7;
    expect_status(colibri_generate(m, ids, n, &s, out, 64, &n_out), COLIBRI_STATUS_INVALID_INPUT,
                  "speculative = 7", "speculative must be");

    /* Bad input: codes and messages, never a crash. */
    uint32_t bad_id = 1u << 30;
    expect_status(colibri_generate(m, &bad_id, 1, NULL, out, 64, &n_out), COLIBRI_STATUS_INVALID_INPUT,
                  "token id out of range", "");
    expect_status(colibri_forward(m, NULL, 3, logits), COLIBRI_STATUS_INVALID_INPUT, "NULL ids", "ids is NULL");
    expect_status(colibri_forward(NULL, ids, n, logits), COLIBRI_STATUS_INVALID_INPUT, "NULL handle", "NULL");
    colibri_sampling_default(&s);
    s.max_new_tokens = 100;
    expect_status(colibri_generate(m, ids, n, &s, out, 64, &n_out), COLIBRI_STATUS_INVALID_INPUT, "small buffer",
                  "room for 64");
    s.max_new_tokens = 8;
    s.top_p = 2.0f;
    expect_status(colibri_generate(m, ids, n, &s, out, 64, &n_out), COLIBRI_STATUS_INVALID_INPUT, "top_p 2",
                  "top_p");
    colibri_sampling zero = {0};
    expect_status(colibri_generate(m, ids, n, &zero, out, 64, &n_out), COLIBRI_STATUS_INVALID_INPUT,
                  "zeroed sampling", "struct_size");
    expect_status(colibri_generate_stream(m, ids, n, NULL, NULL, NULL, NULL), COLIBRI_STATUS_INVALID_INPUT,
                  "NULL callback", "callback is NULL");

    /* One handle, two threads at once: each gets the solo greedy tokens. */
    struct job jobs[2] = {{.m = m, .prompt = ids, .n_prompt = n}, {.m = m, .prompt = ids, .n_prompt = n}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&th[i], NULL, generate_job, &jobs[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        CHECK(jobs[i].status == COLIBRI_STATUS_OK && jobs[i].n_out == 24 &&
                  memcmp(jobs[i].out, greedy, 24 * sizeof(uint32_t)) == 0,
              "thread %d: status %d, %zu tokens, differ from the solo run", i, (int)jobs[i].status, jobs[i].n_out);
    }

    colibri_free(m);
    colibri_free(NULL);
    free(logits);
    free(ids);
    fprintf(stderr, "capi_check: %s (library %s)\n", failures ? "FAILED" : "ok", colibri_version());
    return failures ? 1 : 0;
}
