/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_ns.c - the namespace table of kvpoold (server/kvp_ns.h), its bookkeeping only: attach
 * (new, existing, ownership, root, bad names, a full table, when the lease is taken), find,
 * detach (release now with lease 0, an expiry at now + lease otherwise), expiry, forget and
 * slot reuse, the earliest deadline, and the per-namespace counters. The retry windows
 * (kvp_dedup.h) are not this module's and are not tested here.
 */
#include <check.h>
#include <stdint.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_ns.h"

static kvp_ns_table_t T;

static void setup(uint32_t max)
{
    ck_assert_int_eq(kvp_ns_table_init(&T, max), 0);
}

/* Attaches and returns the id (the call must succeed). */
static uint32_t attach(const char *name, uint32_t uid, uint32_t lease_ms, int set_lease)
{
    uint32_t id = 999;
    ck_assert_int_eq(kvp_ns_attach(&T, name, uid, lease_ms, set_lease, &id), 0);
    ck_assert_uint_lt(id, T.max);
    return id;
}

START_TEST(init_refuses_zero_slots_and_starts_empty)
{
    kvp_ns_table_t t;
    memset(&t, 0xab, sizeof(t));
    ck_assert_int_eq(kvp_ns_table_init(&t, 0), KVP_EINVAL);
    ck_assert_ptr_null(t.ns);
    kvp_ns_table_free(&t); /* a failed init leaves nothing to free */

    setup(3);
    ck_assert_uint_eq(T.max, 3);
    for (uint32_t i = 0; i < 3; i++) {
        ck_assert_int_eq(T.ns[i].in_use, 0);
        ck_assert_uint_eq(T.ns[i].sessions, 0);
    }
    ck_assert_int_eq(kvp_ns_find(&T, "eng"), -1);
    ck_assert_int_eq(kvp_ns_next_expired(&T, UINT64_MAX), -1);
    ck_assert_uint_eq(kvp_ns_next_deadline(&T), UINT64_MAX);
    kvp_ns_table_free(&T);
    ck_assert_ptr_null(T.ns);
    kvp_ns_table_free(&T); /* twice: a no-op */
}
END_TEST

START_TEST(attach_creates_a_namespace_owned_by_the_caller)
{
    setup(4);
    uint32_t a = attach("eng", 1000, 5000, 1);
    ck_assert_uint_eq(a, 0);
    const kvp_ns_t *n = &T.ns[a];
    ck_assert_int_eq(n->in_use, 1);
    ck_assert_str_eq(n->name, "eng");
    ck_assert_uint_eq(n->owner_uid, 1000);
    ck_assert_uint_eq(n->sessions, 1);
    ck_assert_uint_eq(n->lease_ms, 5000);
    ck_assert_uint_eq(n->expires_at_ms, 0);
    ck_assert_uint_eq(n->buffer_bytes, 0);
    ck_assert_int_eq(kvp_ns_find(&T, "eng"), 0);

    /* a second name takes the next slot; names are compared exactly */
    uint32_t b = attach("Eng", 1000, 0, 0);
    ck_assert_uint_eq(b, 1);
    ck_assert_int_eq(kvp_ns_find(&T, "Eng"), 1);
    ck_assert_int_eq(kvp_ns_find(&T, "eng"), 0);
    ck_assert_int_eq(kvp_ns_find(&T, "en"), -1);
    ck_assert_int_eq(kvp_ns_find(&T, "engx"), -1);
    kvp_ns_table_free(&T);
}
END_TEST

START_TEST(attach_to_an_existing_namespace_counts_a_session)
{
    setup(4);
    uint32_t a = attach("eng", 1000, 5000, 1);
    attach("other", 1000, 0, 1);
    ck_assert_uint_eq(attach("eng", 1000, 5000, 1), a);
    ck_assert_uint_eq(attach("eng", 1000, 5000, 1), a);
    ck_assert_uint_eq(T.ns[a].sessions, 3);
    ck_assert_uint_eq(T.ns[a].owner_uid, 1000);
    ck_assert_uint_eq(T.ns[1].sessions, 1); /* the other namespace is untouched */
    kvp_ns_table_free(&T);
}
END_TEST

START_TEST(another_uid_is_refused_and_root_may_attach_to_any)
{
    setup(4);
    uint32_t a = attach("eng", 1000, 5000, 1);
    uint32_t id = 77;
    ck_assert_int_eq(kvp_ns_attach(&T, "eng", 1001, 9000, 1, &id), KVP_EPERM);
    ck_assert_uint_eq(id, 77);              /* not written on failure */
    ck_assert_uint_eq(T.ns[a].sessions, 1); /* no session counted */
    ck_assert_uint_eq(T.ns[a].lease_ms, 5000);
    /* root attaches, and the namespace stays the owner's */
    ck_assert_uint_eq(attach("eng", 0, 5000, 0), a);
    ck_assert_uint_eq(T.ns[a].sessions, 2);
    ck_assert_uint_eq(T.ns[a].owner_uid, 1000);
    /* a namespace root created is root's: an ordinary uid may not join it */
    uint32_t r = attach("sys", 0, 0, 1);
    ck_assert_uint_eq(T.ns[r].owner_uid, 0);
    ck_assert_int_eq(kvp_ns_attach(&T, "sys", 1000, 0, 1, &id), KVP_EPERM);
    ck_assert_uint_eq(T.ns[r].sessions, 1);
    kvp_ns_table_free(&T);
}
END_TEST

START_TEST(empty_or_too_long_names_are_refused)
{
    setup(4);
    uint32_t id = 77;
    char longest[KVP_NS_NAME_MAX + 2];
    ck_assert_int_eq(kvp_ns_attach(&T, "", 1000, 0, 1, &id), KVP_EINVAL);
    ck_assert_int_eq(kvp_ns_attach(&T, NULL, 1000, 0, 1, &id), KVP_EINVAL);
    memset(longest, 'n', KVP_NS_NAME_MAX + 1);
    longest[KVP_NS_NAME_MAX + 1] = '\0'; /* 65 bytes: one too many */
    ck_assert_int_eq(kvp_ns_attach(&T, longest, 1000, 0, 1, &id), KVP_EINVAL);
    ck_assert_uint_eq(id, 77);
    for (uint32_t i = 0; i < T.max; i++)
        ck_assert_int_eq(T.ns[i].in_use, 0);
    longest[KVP_NS_NAME_MAX] = '\0'; /* 64 bytes: the longest allowed */
    uint32_t a = attach(longest, 1000, 0, 1);
    ck_assert_uint_eq(strlen(T.ns[a].name), KVP_NS_NAME_MAX);
    ck_assert_str_eq(T.ns[a].name, longest);
    ck_assert_int_eq(kvp_ns_find(&T, longest), (int)a);
    kvp_ns_table_free(&T);
}
END_TEST

START_TEST(a_full_table_refuses_new_names_but_not_existing_ones)
{
    setup(2);
    uint32_t a = attach("a", 1000, 0, 1);
    uint32_t b = attach("b", 1000, 0, 1);
    uint32_t id = 77;
    ck_assert_int_eq(kvp_ns_attach(&T, "c", 1000, 0, 1, &id), KVP_ELIMIT);
    ck_assert_uint_eq(id, 77);
    ck_assert_int_eq(kvp_ns_find(&T, "c"), -1);
    ck_assert_uint_eq(attach("a", 1000, 0, 1), a); /* joining an existing one still works */
    ck_assert_uint_eq(T.ns[a].sessions, 2);
    /* the other uid's refusal wins over the full table for an existing name */
    ck_assert_int_eq(kvp_ns_attach(&T, "b", 1001, 0, 1, &id), KVP_EPERM);
    /* a freed slot takes the new name */
    ck_assert_int_eq(kvp_ns_detach(&T, b, 10), 1);
    kvp_ns_forget(&T, b);
    ck_assert_uint_eq(attach("c", 1000, 0, 1), b);
    kvp_ns_table_free(&T);
}
END_TEST

START_TEST(lease_is_taken_by_a_new_namespace_and_by_an_existing_one_only_when_set)
{
    setup(4);
    /* new: takes lease_ms even when set_lease is 0 (the daemon passes its default) */
    uint32_t a = attach("eng", 1000, 500, 0);
    ck_assert_uint_eq(T.ns[a].lease_ms, 500);
    /* existing, no lease named (an observer): unchanged */
    attach("eng", 1000, 9999, 0);
    ck_assert_uint_eq(T.ns[a].lease_ms, 500);
    /* existing, a lease named: taken, 0 included */
    attach("eng", 1000, 7000, 1);
    ck_assert_uint_eq(T.ns[a].lease_ms, 7000);
    attach("eng", 0, 0, 1);
    ck_assert_uint_eq(T.ns[a].lease_ms, 0);
    ck_assert_uint_eq(T.ns[a].sessions, 4);
    kvp_ns_table_free(&T);
}
END_TEST

START_TEST(last_detach_with_lease_zero_asks_for_release_now)
{
    setup(4);
    uint32_t a = attach("eng", 1000, 0, 1);
    attach("eng", 1000, 0, 1);
    ck_assert_int_eq(kvp_ns_detach(&T, a, 100), 0); /* one session left */
    ck_assert_uint_eq(T.ns[a].sessions, 1);
    ck_assert_uint_eq(T.ns[a].expires_at_ms, 0);
    ck_assert_int_eq(kvp_ns_detach(&T, a, 200), 1); /* the last one: release now */
    ck_assert_uint_eq(T.ns[a].sessions, 0);
    ck_assert_uint_eq(T.ns[a].expires_at_ms, 0); /* nothing scheduled */
    ck_assert_int_eq(T.ns[a].in_use, 1);         /* the caller forgets it */
    ck_assert_uint_eq(kvp_ns_next_deadline(&T), UINT64_MAX);
    ck_assert_int_eq(kvp_ns_next_expired(&T, UINT64_MAX), -1);
    /* a detach with no session left changes nothing (no underflow) */
    ck_assert_int_eq(kvp_ns_detach(&T, a, 300), 0);
    ck_assert_uint_eq(T.ns[a].sessions, 0);
    /* nor does one of a free slot */
    ck_assert_int_eq(kvp_ns_detach(&T, 3, 300), 0);
    ck_assert_int_eq(T.ns[3].in_use, 0);
    ck_assert_uint_eq(T.ns[3].sessions, 0);
    kvp_ns_forget(&T, a);
    ck_assert_int_eq(T.ns[a].in_use, 0);
    ck_assert_int_eq(kvp_ns_find(&T, "eng"), -1);
    kvp_ns_table_free(&T);
}
END_TEST

START_TEST(last_detach_with_a_lease_schedules_expiry_at_now_plus_lease)
{
    setup(4);
    uint32_t a = attach("eng", 1000, 3000, 1);
    attach("eng", 1000, 3000, 1);
    ck_assert_int_eq(kvp_ns_detach(&T, a, 10000), 0);
    ck_assert_uint_eq(T.ns[a].expires_at_ms, 0); /* a session is still attached */
    ck_assert_int_eq(kvp_ns_detach(&T, a, 10000), 0);
    ck_assert_uint_eq(T.ns[a].sessions, 0);
    ck_assert_uint_eq(T.ns[a].expires_at_ms, 13000);
    ck_assert_uint_eq(kvp_ns_next_deadline(&T), 13000);
    /* a second detach does not move the deadline */
    ck_assert_int_eq(kvp_ns_detach(&T, a, 12000), 0);
    ck_assert_uint_eq(T.ns[a].expires_at_ms, 13000);

    ck_assert_int_eq(kvp_ns_next_expired(&T, 12999), -1);
    ck_assert_uint_eq(T.ns[a].expires_at_ms, 13000);
    ck_assert_int_eq(kvp_ns_next_expired(&T, 13000), (int)a); /* due at exactly the deadline */
    ck_assert_uint_eq(T.ns[a].expires_at_ms, 0);              /* cleared: reported once */
    ck_assert_int_eq(kvp_ns_next_expired(&T, 13000), -1);
    ck_assert_uint_eq(kvp_ns_next_deadline(&T), UINT64_MAX);
    ck_assert_int_eq(T.ns[a].in_use, 1); /* until the caller forgets it */
    kvp_ns_forget(&T, a);
    ck_assert_int_eq(kvp_ns_find(&T, "eng"), -1);
    kvp_ns_table_free(&T);
}
END_TEST

START_TEST(attach_cancels_a_pending_expiry)
{
    setup(4);
    uint32_t a = attach("eng", 1000, 3000, 1);
    ck_assert_int_eq(kvp_ns_detach(&T, a, 1000), 0);
    ck_assert_uint_eq(T.ns[a].expires_at_ms, 4000);
    /* the engine reconnects within its lease (an observer without a lease too) */
    ck_assert_uint_eq(attach("eng", 1000, 0, 0), a);
    ck_assert_uint_eq(T.ns[a].sessions, 1);
    ck_assert_uint_eq(T.ns[a].expires_at_ms, 0);
    ck_assert_uint_eq(T.ns[a].lease_ms, 3000);
    ck_assert_uint_eq(kvp_ns_next_deadline(&T), UINT64_MAX);
    ck_assert_int_eq(kvp_ns_next_expired(&T, UINT64_MAX), -1);
    kvp_ns_table_free(&T);
}
END_TEST

START_TEST(deadlines_and_expiries_over_several_namespaces)
{
    setup(4);
    uint32_t a = attach("a", 1000, 5000, 1);
    uint32_t b = attach("b", 1000, 1000, 1);
    uint32_t c = attach("c", 1000, 2000, 1);
    uint32_t d = attach("d", 1000, 100, 1);       /* stays attached: never expires */
    ck_assert_int_eq(kvp_ns_detach(&T, a, 0), 0); /* due 5000 */
    ck_assert_int_eq(kvp_ns_detach(&T, b, 0), 0); /* due 1000 */
    ck_assert_int_eq(kvp_ns_detach(&T, c, 0), 0); /* due 2000 */
    ck_assert_uint_eq(kvp_ns_next_deadline(&T), 1000);
    ck_assert_int_eq(kvp_ns_next_expired(&T, 999), -1);
    /* at 2500 both b and c are due: one per call, in slot order */
    ck_assert_int_eq(kvp_ns_next_expired(&T, 2500), (int)b);
    ck_assert_uint_eq(kvp_ns_next_deadline(&T), 2000);
    ck_assert_int_eq(kvp_ns_next_expired(&T, 2500), (int)c);
    ck_assert_int_eq(kvp_ns_next_expired(&T, 2500), -1);
    ck_assert_uint_eq(kvp_ns_next_deadline(&T), 5000);
    kvp_ns_forget(&T, b);
    kvp_ns_forget(&T, c);
    ck_assert_uint_eq(kvp_ns_next_deadline(&T), 5000);
    ck_assert_int_eq(kvp_ns_next_expired(&T, UINT64_MAX), (int)a);
    ck_assert_uint_eq(kvp_ns_next_deadline(&T), UINT64_MAX);
    ck_assert_uint_eq(T.ns[d].sessions, 1);
    ck_assert_uint_eq(T.ns[d].expires_at_ms, 0);
    kvp_ns_table_free(&T);
}
END_TEST

START_TEST(forget_frees_the_slot_for_reuse_and_resets_its_counters)
{
    setup(2);
    uint32_t a = attach("eng", 1000, 3000, 1);
    attach("other", 1000, 0, 1);
    T.ns[a].buffer_bytes = 4096; /* the rpc layer's count of registered buffers */
    /* forget of a namespace with a session: refused (nothing changes) */
    kvp_ns_forget(&T, a);
    ck_assert_int_eq(T.ns[a].in_use, 1);
    ck_assert_uint_eq(T.ns[a].sessions, 1);
    ck_assert_uint_eq(T.ns[a].buffer_bytes, 4096);
    ck_assert_int_eq(kvp_ns_find(&T, "eng"), (int)a);
    /* attach and detach leave the buffer count to its owner */
    attach("eng", 1000, 3000, 1);
    ck_assert_uint_eq(T.ns[a].buffer_bytes, 4096);
    ck_assert_int_eq(kvp_ns_detach(&T, a, 50), 0);
    ck_assert_int_eq(kvp_ns_detach(&T, a, 50), 0);
    ck_assert_uint_eq(T.ns[a].buffer_bytes, 4096);
    ck_assert_int_eq(kvp_ns_next_expired(&T, 3050), (int)a);
    kvp_ns_forget(&T, a);
    ck_assert_int_eq(T.ns[a].in_use, 0);
    ck_assert_int_eq(kvp_ns_find(&T, "eng"), -1);
    /* the slot is reused by another owner's name, from a clean state */
    uint32_t id = attach("new", 2000, 0, 0);
    ck_assert_uint_eq(id, a);
    ck_assert_str_eq(T.ns[id].name, "new");
    ck_assert_uint_eq(T.ns[id].owner_uid, 2000);
    ck_assert_uint_eq(T.ns[id].sessions, 1);
    ck_assert_uint_eq(T.ns[id].lease_ms, 0);
    ck_assert_uint_eq(T.ns[id].expires_at_ms, 0);
    ck_assert_uint_eq(T.ns[id].buffer_bytes, 0);
    /* and the old name is a new namespace again (in no slot: the table is full) */
    ck_assert_int_eq(kvp_ns_attach(&T, "eng", 1000, 0, 1, &id), KVP_ELIMIT);
    kvp_ns_table_free(&T);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("ns");
    TCase *tc = tcase_create("ns");
    tcase_add_test(tc, init_refuses_zero_slots_and_starts_empty);
    tcase_add_test(tc, attach_creates_a_namespace_owned_by_the_caller);
    tcase_add_test(tc, attach_to_an_existing_namespace_counts_a_session);
    tcase_add_test(tc, another_uid_is_refused_and_root_may_attach_to_any);
    tcase_add_test(tc, empty_or_too_long_names_are_refused);
    tcase_add_test(tc, a_full_table_refuses_new_names_but_not_existing_ones);
    tcase_add_test(tc, lease_is_taken_by_a_new_namespace_and_by_an_existing_one_only_when_set);
    tcase_add_test(tc, last_detach_with_lease_zero_asks_for_release_now);
    tcase_add_test(tc, last_detach_with_a_lease_schedules_expiry_at_now_plus_lease);
    tcase_add_test(tc, attach_cancels_a_pending_expiry);
    tcase_add_test(tc, deadlines_and_expiries_over_several_namespaces);
    tcase_add_test(tc, forget_frees_the_slot_for_reuse_and_resets_its_counters);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
