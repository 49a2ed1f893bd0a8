/* The scheduler's two per-request hot loops for plain decodes, in C (services/scheduler/fastpath/__init__.py).

A plain decode is one token for a request with no drafts and (under async scheduling) room to run ahead; on the
way back, one sampled token that does not stop it. 1 in block_size of them crosses a block: the C loop calls the
KV manager's own Python methods for that block (allocate_slots on the way out, cache_blocks on the way back)
and goes on, rather than returning to the Python loop for it. Each function runs
over consecutive plain decodes and returns the index of the first request it does NOT handle, which the Python
loop (running_pass.py, step_update.py) then takes through the one Python path before calling back in. So the C
code never preempts, stops or finishes a request, nor touches the block pool itself: for a plain decode it does
exactly what the Python path does (same fields, same calls, same order), and anything else goes back to Python.
The stop rule is the one encoding of services/scheduler/stop_rule.py (stop_ids, min_output_tokens,
max_output_tokens), applied here as stop_status applies it.

Request and RequestOutput are slots dataclasses; `init` reads their member offsets once, so a field read here
is one load. Ints are checked to be exact ints, lists exact lists; anything else returns to Python. The GIL is
held throughout: this is ordinary single-threaded object manipulation, only without the bytecode dispatch.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

enum { R_NUM_COMPUTED, R_PLACEHOLDERS, R_OUTPUT_IDS, R_NUM_PROMPT, R_SPEC, R_MAX_OUTPUT, R_HANDLE, R_STATUS,
       R_STOP_IDS, R_MIN_OUTPUT, R_SENDS_PROMPT_LP, R_REQUEST_ID, R_NUM_CACHED, R_COUNT };
static const char *REQUEST_FIELDS[R_COUNT] = {
    "num_computed_tokens", "num_output_placeholders", "output_token_ids", "num_prompt", "spec_token_ids",
    "max_output_tokens", "handle", "status", "stop_ids", "min_output_tokens", "sends_prompt_logprobs",
    "request_id", "num_cached_tokens"};

/* RequestOutput's fields, in its dataclass order; the last three take their defaults here. */
enum { O_REQUEST_ID, O_NEW_TOKENS, O_LOGPROBS, O_FINISH, O_STOP_ID, O_NUM_PROMPT, O_NUM_OUTPUT, O_NUM_CACHED,
       O_ERROR, O_PROMPT_LP, O_EMBEDDING, O_COUNT };
static const char *OUTPUT_FIELDS[O_COUNT] = {
    "request_id", "new_token_ids", "logprobs", "finish_reason", "stop_token_id", "num_prompt_tokens",
    "num_output_tokens", "num_cached_tokens", "error", "prompt_logprobs", "embedding"};

static PyTypeObject *request_type, *output_type;
static Py_ssize_t r_off[R_COUNT], o_off[O_COUNT];
static PyObject *empty_str, *running_status;

#define FIELD(obj, off) (*(PyObject **)((char *)(obj) + (off)))

static int member_offset(PyTypeObject *type, const char *name, Py_ssize_t *out) {
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, name);
    if (descr == NULL) return -1;
    int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
             ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
    if (ok) *out = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    if (!ok) PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, name);
    return ok ? 0 : -1;
}

/* init(Request, RequestOutput, RUNNING): reads the slot offsets; raises if either class is not as expected. */
static PyObject *init(PyObject *self, PyObject *args) {
    PyObject *req, *out, *running;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyType_Type, &req, &PyType_Type, &out, &running)) return NULL;
    for (int i = 0; i < R_COUNT; i++)
        if (member_offset((PyTypeObject *)req, REQUEST_FIELDS[i], &r_off[i]) < 0) return NULL;
    for (int i = 0; i < O_COUNT; i++)
        if (member_offset((PyTypeObject *)out, OUTPUT_FIELDS[i], &o_off[i]) < 0) return NULL;
    if (((PyTypeObject *)out)->tp_dictoffset != 0) {
        PyErr_SetString(PyExc_TypeError, "RequestOutput must have no __dict__");
        return NULL;
    }
    Py_XSETREF(request_type, (PyTypeObject *)Py_NewRef(req));
    Py_XSETREF(output_type, (PyTypeObject *)Py_NewRef(out));
    Py_XSETREF(running_status, Py_NewRef(running));
    if (empty_str == NULL && (empty_str = PyUnicode_FromString("")) == NULL) return NULL;
    Py_RETURN_NONE;
}

/* An exact int's value, or -1 with *bad set (not an int, negative or out of range). */
static inline Py_ssize_t int_field(PyObject *v, int *bad) {
    if (v == NULL || !PyLong_CheckExact(v)) { *bad = 1; return -1; }
    Py_ssize_t x = PyLong_AsSsize_t(v);
    if (x < 0) { PyErr_Clear(); *bad = 1; return -1; }
    return x;
}

static inline int set_int(PyObject *obj, Py_ssize_t off, Py_ssize_t value) {
    PyObject *v = PyLong_FromSsize_t(value);
    if (v == NULL) return -1;
    Py_XSETREF(FIELD(obj, off), v);
    return 0;
}

static inline int append_int(PyObject *list, Py_ssize_t value) {
    PyObject *v = PyLong_FromSsize_t(value);
    if (v == NULL) return -1;
    int rc = PyList_Append(list, v);
    Py_DECREF(v);
    return rc;
}

/* schedule_decodes(running, i, budget, last_position, block_size, runs_ahead, awaiting,
                    handles, counts, scheduled, ends, allocate, cached_handles, cached_computed, cached_blocks)
       -> (i, budget, num_decodes, context)

   running_pass.schedule_running's Python path for plain decodes (_num_new_tokens gives 1, allocate_slots,
   _add_to_batch, _advance), from running[i] on, while budget lasts: stops at the first request that is not a
   plain decode (or at the end of the list). A decode whose last block is full gets its next block from
   `allocate` (KVCacheManager.allocate_slots, called with (request, 1)), recorded in the plan's
   CachedRequestData lists as plan.cached.append does; when allocate returns None (no free block: nothing was
   allocated, and Python preempts), it stops there too. `runs_ahead` (AsyncScheduler._schedule_decodes): each
   decode of a request that samples adds an output placeholder, as AsyncScheduler._advance does; `awaiting`:
   the requests whose drafts are in flight, which wait (AsyncScheduler._num_new_tokens). */
static PyObject *schedule_decodes(PyObject *self, PyObject *args) {
    PyObject *running, *awaiting, *handles, *counts, *scheduled, *ends, *allocate;
    PyObject *cached_handles, *cached_computed, *cached_blocks;
    Py_ssize_t i, budget, last_position, block_size;
    int runs_ahead;
    if (!PyArg_ParseTuple(args, "O!nnnnpOO!O!O!O!OO!O!O!", &PyList_Type, &running, &i, &budget, &last_position,
                          &block_size, &runs_ahead, &awaiting, &PyList_Type, &handles, &PyList_Type, &counts,
                          &PyList_Type, &scheduled, &PyList_Type, &ends, &allocate, &PyList_Type,
                          &cached_handles, &PyList_Type, &cached_computed, &PyList_Type, &cached_blocks))
        return NULL;
    if (block_size <= 0) return Py_BuildValue("nnnn", i, budget, (Py_ssize_t)0, (Py_ssize_t)0);
    if (request_type == NULL) { PyErr_SetString(PyExc_RuntimeError, "init() was not called"); return NULL; }
    int check_awaiting = PyAnySet_Check(awaiting) && PySet_GET_SIZE(awaiting) > 0;
    Py_ssize_t num_decodes = 0, context = 0;
    PyObject *one = PyLong_FromLong(1);               /* a small int: immortal in practice, counted anyway */
    for (; i < PyList_GET_SIZE(running) && budget > 0; i++) {
        PyObject *r = PyList_GET_ITEM(running, i);
        if (Py_TYPE(r) != request_type) break;
        int bad = 0;
        Py_ssize_t computed = int_field(FIELD(r, r_off[R_NUM_COMPUTED]), &bad);
        Py_ssize_t placeholders = int_field(FIELD(r, r_off[R_PLACEHOLDERS]), &bad);
        Py_ssize_t num_prompt = int_field(FIELD(r, r_off[R_NUM_PROMPT]), &bad);
        Py_ssize_t max_output = int_field(FIELD(r, r_off[R_MAX_OUTPUT]), &bad);
        PyObject *outputs = FIELD(r, r_off[R_OUTPUT_IDS]), *spec = FIELD(r, r_off[R_SPEC]);
        PyObject *handle = FIELD(r, r_off[R_HANDLE]);
        if (bad || outputs == NULL || !PyList_CheckExact(outputs) || spec == NULL || !PyList_CheckExact(spec)
            || handle == NULL || !PyLong_CheckExact(handle))
            break;
        Py_ssize_t num_output = PyList_GET_SIZE(outputs);
        int decode = num_prompt + num_output + placeholders - computed == 1 && computed < last_position
                     && PyList_GET_SIZE(spec) == 0
                     && (!placeholders || num_output + placeholders < max_output);
        if (decode && placeholders && check_awaiting) {
            int in = PySet_Contains(awaiting, r);
            if (in < 0) goto error;
            decode = !in;
        }
        if (!decode) break;
        if (computed % block_size == 0) {                 /* its last block is full: the next one first */
            PyObject *blocks = PyObject_CallFunctionObjArgs(allocate, r, one, NULL);
            if (blocks == NULL) goto error;
            if (blocks == Py_None) { Py_DECREF(blocks); break; }
            int rc = 0;
            if (!PyList_CheckExact(blocks)) {
                PyErr_SetString(PyExc_TypeError, "allocate_slots must return a list or None");
                rc = -1;
            } else if (PyList_GET_SIZE(blocks)) {
                rc = PyList_Append(cached_handles, handle) < 0 || append_int(cached_computed, computed) < 0
                     || PyList_Append(cached_blocks, blocks) < 0 ? -1 : 0;
            }
            Py_DECREF(blocks);
            if (rc < 0) goto error;
        }
        computed += 1;
        PyObject *end = PyLong_FromSsize_t(computed);     /* one object, as in Python: the field and ends[] */
        if (end == NULL) goto error;
        Py_XSETREF(FIELD(r, r_off[R_NUM_COMPUTED]), end);
        if (PyList_Append(handles, handle) < 0 || PyList_Append(counts, one) < 0
            || PyList_Append(scheduled, r) < 0 || PyList_Append(ends, end) < 0)
            goto error;
        if (runs_ahead && max_output && set_int(r, r_off[R_PLACEHOLDERS], placeholders + 1) < 0) goto error;
        num_decodes += 1;
        context += computed;
        budget -= 1;
    }
    Py_DECREF(one);
    return Py_BuildValue("nnnn", i, budget, num_decodes, context);
error:
    Py_DECREF(one);
    return NULL;
}

/* apply_decodes(requests, ends, handles, counts, k, sampled, outputs, block_size, cache_blocks) -> k

   step_update.apply_result's Python path for a plain decode (append_tokens with one token and no drafts), from
   index k of the step's parallel lists: skips requests that are no longer running, appends one sampled token
   that does not stop the request (the stop rule: stop_rule.stop_status), and appends its RequestOutput.
   A token that fills a block has it keyed by `cache_blocks` (KVCacheManager.cache_blocks, called with
   (request, min(end, prompt + output tokens))) between the two, as the Python path does. Stops at the first
   request that needs anything else. */
static PyObject *apply_decodes(PyObject *self, PyObject *args) {
    PyObject *requests, *ends, *handles, *counts, *sampled, *outputs, *cache_blocks;
    Py_ssize_t k, block_size;
    if (!PyArg_ParseTuple(args, "O!O!O!O!nO!O!nO", &PyList_Type, &requests, &PyList_Type, &ends, &PyList_Type,
                          &handles, &PyList_Type, &counts, &k, &PyDict_Type, &sampled, &PyList_Type, &outputs,
                          &block_size, &cache_blocks))
        return NULL;
    if (request_type == NULL) { PyErr_SetString(PyExc_RuntimeError, "init() was not called"); return NULL; }
    if (block_size <= 0) return PyLong_FromSsize_t(k);
    Py_ssize_t n = Py_MIN(Py_MIN(PyList_GET_SIZE(requests), PyList_GET_SIZE(ends)),
                          Py_MIN(PyList_GET_SIZE(handles), PyList_GET_SIZE(counts)));
    for (; k < n; k++) {
        PyObject *r = PyList_GET_ITEM(requests, k);
        if (Py_TYPE(r) != request_type) break;
        PyObject *status = FIELD(r, r_off[R_STATUS]);
        if (status == NULL) break;
        if (status != running_status) continue;           /* finished, aborted or preempted since: dropped */
        PyObject *handle = PyList_GET_ITEM(handles, k);
        PyObject *tokens = PyDict_GetItemWithError(sampled, handle);   /* borrowed */
        if (tokens == NULL) {
            if (PyErr_Occurred()) return NULL;
            break;                                        /* a prompt chunk: Python keys its blocks */
        }
        if (!PyList_CheckExact(tokens) || PyList_GET_SIZE(tokens) != 1) break;
        PyObject *token = PyList_GET_ITEM(tokens, 0);
        int bad = 0;
        Py_ssize_t end = int_field(PyList_GET_ITEM(ends, k), &bad);
        Py_ssize_t num_new = int_field(PyList_GET_ITEM(counts, k), &bad);
        Py_ssize_t max_output = int_field(FIELD(r, r_off[R_MAX_OUTPUT]), &bad);
        Py_ssize_t min_output = int_field(FIELD(r, r_off[R_MIN_OUTPUT]), &bad);
        Py_ssize_t placeholders = int_field(FIELD(r, r_off[R_PLACEHOLDERS]), &bad);
        PyObject *num_prompt = FIELD(r, r_off[R_NUM_PROMPT]);
        Py_ssize_t prompt_len = int_field(num_prompt, &bad);   /* the output carries the object itself */
        PyObject *output_ids = FIELD(r, r_off[R_OUTPUT_IDS]), *spec = FIELD(r, r_off[R_SPEC]);
        PyObject *stop_ids = FIELD(r, r_off[R_STOP_IDS]), *sends = FIELD(r, r_off[R_SENDS_PROMPT_LP]);
        PyObject *request_id = FIELD(r, r_off[R_REQUEST_ID]), *cached = FIELD(r, r_off[R_NUM_CACHED]);
        if (bad || output_ids == NULL || !PyList_CheckExact(output_ids) || spec == NULL
            || !PyList_CheckExact(spec) || PyList_GET_SIZE(spec) || stop_ids == NULL || !PyAnySet_Check(stop_ids)
            || sends != Py_False || request_id == NULL || cached == NULL)
            break;
        Py_ssize_t num_output = PyList_GET_SIZE(output_ids) + 1;
        int fills = end % block_size < num_new;
        if (num_output >= max_output) break;              /* the stop rule: it stops, Python finishes it */
        if (num_output >= min_output) {
            int stops = PySet_Contains(stop_ids, token);
            if (stops < 0) return NULL;
            if (stops) break;
        }
        PyObject *out = output_type->tp_alloc(output_type, 0);
        if (out == NULL) return NULL;
        PyObject *num_output_obj = PyLong_FromSsize_t(num_output);
        if (num_output_obj == NULL) { Py_DECREF(out); return NULL; }
        FIELD(out, o_off[O_REQUEST_ID]) = Py_NewRef(request_id);
        FIELD(out, o_off[O_NEW_TOKENS]) = Py_NewRef(tokens);
        FIELD(out, o_off[O_LOGPROBS]) = Py_NewRef(Py_None);
        FIELD(out, o_off[O_FINISH]) = Py_NewRef(Py_None);
        FIELD(out, o_off[O_STOP_ID]) = Py_NewRef(Py_None);
        FIELD(out, o_off[O_NUM_PROMPT]) = Py_NewRef(num_prompt);
        FIELD(out, o_off[O_NUM_OUTPUT]) = num_output_obj;
        FIELD(out, o_off[O_NUM_CACHED]) = Py_NewRef(cached);
        FIELD(out, o_off[O_ERROR]) = Py_NewRef(empty_str);
        FIELD(out, o_off[O_PROMPT_LP]) = Py_NewRef(Py_None);
        FIELD(out, o_off[O_EMBEDDING]) = Py_NewRef(Py_None);
        if ((placeholders && set_int(r, r_off[R_PLACEHOLDERS], placeholders - 1) < 0)
            || PyList_Append(output_ids, token) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        if (fills) {                                      /* key the block it filled, before the output */
            PyObject *upto = PyLong_FromSsize_t(Py_MIN(end, prompt_len + num_output));
            PyObject *done = upto == NULL ? NULL : PyObject_CallFunctionObjArgs(cache_blocks, r, upto, NULL);
            Py_XDECREF(upto);
            if (done == NULL) { Py_DECREF(out); return NULL; }
            Py_DECREF(done);
        }
        int rc = PyList_Append(outputs, out);
        Py_DECREF(out);
        if (rc < 0) return NULL;
    }
    return PyLong_FromSsize_t(k);
}

static PyMethodDef METHODS[] = {
    {"init", init, METH_VARARGS, "init(Request, RequestOutput, RUNNING): read the classes' slot offsets"},
    {"schedule_decodes", schedule_decodes, METH_VARARGS, "the schedule loop's plain decodes from index i"},
    {"apply_decodes", apply_decodes, METH_VARARGS, "the result loop's plain decodes from index k"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "steploop_decode_loop", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit_steploop_decode_loop(void) { return PyModule_Create(&MODULE); }
