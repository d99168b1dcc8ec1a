/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache.h - the prefix cache (DESIGN.md §9, issue #16): content keys of full pages made
 * findable, cached pages kept after their last reference, eviction, pins.
 *
 * State of a page, beside the allocator's refcount:
 *   keyed      a full page of a sequence with token ids has a key (kvp_pagekey.h) and a scope,
 *              written by the planner when the page becomes full. Not findable yet.
 *   indexed    published (kvp_pcache_publish): in the key table, findable by Lookup and reuse.
 *              At most one page per (scope, key) is indexed: a second page with the same
 *              content stays keyed and private and is freed like any other page.
 *   cached     indexed with refcount 0: in an eviction list instead of the free stack.
 *   pinned     a pin holds a reference (so it is never cached while pinned).
 * A page leaves the table when it is evicted (allocation under pressure, flush), rewritten
 * (a truncate made it partial again while it was its sole holder's last page) or its restore
 * from the host tier failed.
 *
 * Eviction order: one list per retention priority (0..100), each ordered by release time (a
 * page enters its list's tail when its refcount reaches 0); allocation evicts the head of the
 * lowest non-empty list. A sequence releases its pages last first, so of a chain released
 * together the deepest page goes first; since every holder of a page holds its whole chain
 * before it, a page's ancestors are released no earlier than it is and the deepest-first order
 * holds across sequences too (unless priorities differ). A page released with a retention
 * duration keeps its priority that long, then counts as KVP_PCACHE_DEFAULT_PRIORITY (a heap of
 * expiries, checked at eviction). Everything is O(1) per page but the retention heap
 * (O(log n) when a page with a duration is released or reused) and flush (O(cached pages)).
 *
 * Identity and tiers (issues #27, #28): the cache names where an entry's content lives with a
 * kvp_loc_t (kvp_loc.h), not a page id. An entry lives in exactly one place: a GPU page (the
 * states above) or a slot of the host tier (KVP_MEDIUM_HOST, slots 0..host_slots-1, of which
 * [0, kvp_pcache_set_host_limit) are usable). The cache owns the slots (free, holding an entry,
 * or busy with a move) but never copies bytes: the daemon copies between the begin and end
 * calls below, on its worker threads, and reports how each copy ended.
 *   demotion   kvp_pcache_demote_begin takes cached GPU pages in eviction order and pairs each
 *              with a host slot. The page is DEMOTING: still the entry's place (indexed,
 *              findable, linkable: a link or a pin cancels the demotion), neither cached nor
 *              free (the allocator neither hands it out nor counts it available). At
 *              kvp_pcache_demote_end a demotion still untouched moves the entry to the slot
 *              and frees the page; a failed one makes the page cached again; a cancelled one
 *              only frees the slot.
 *   host tier  an entry in a slot is findable by kvp_pcache_locate and kvp_pcache_lookup_tiers,
 *              never handed out as a page (kvp_pcache_find, Lookup, plain reuse and pins see
 *              GPU pages only). Its own eviction order: by priority, then demotion order (a
 *              retention duration keeps counting there). A demotion that finds no free slot
 *              drops the head of that order for good; so does lowering the limit below it.
 *              Publishing the same content on the GPU replaces a host entry.
 *   promotion  the planner with reuse and promote (kvp_plan_cache_t) continues a found prefix
 *              into the host tier: each host entry gets a fresh GPU page that takes its
 *              identity at once (indexed there, RESTORING, pinned) while the slot, now busy,
 *              is read; kvp_pcache_restore_end ends it (a failed restore leaves the page
 *              private, its key unindexed). Calls that link a RESTORING page wait for it
 *              (kvp_pcache_restoring).
 * A key therefore lives in one place or is in flight between two, where it is still its GPU
 * page's entry. With the limit at 0 (the start) nothing is ever demoted and the cache behaves
 * exactly as without a tier. The functions taking or returning a plain page id (find,
 * page_state, page_key, eviction_order) are the GPU medium's view.
 *
 * Scopes are small integers the caller assigns (0..max_scopes-1); pages of different scopes
 * never match. Times are caller-supplied milliseconds; the core reads no clock. Not
 * thread-safe: the daemon's loop thread. The cache attaches itself to the sequence table and
 * its allocator at create and detaches at destroy; it must be destroyed before them.
 */
#ifndef KVP_PCACHE_H
#define KVP_PCACHE_H

#include <stdint.h>

#include "kvp_loc.h"
#include "kvp_pagekey.h"
#include "kvp_seqtab.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_pcache kvp_pcache_t;

#define KVP_PCACHE_MAX_PRIORITY     100u
#define KVP_PCACHE_DEFAULT_PRIORITY 35u /* TensorRT-LLM's default retention priority */
#define KVP_PCACHE_NO_SCOPE         UINT32_MAX

typedef struct {
    uint32_t max_scopes;  /* scope ids 0..max_scopes-1 (>= 1) */
    uint32_t max_pins;    /* pins alive at once (>= 1) */
    uint32_t host_slots;  /* host-tier slots the cache can ever use (0..host_slots-1; 0: none,
                             the default), usable up to kvp_pcache_set_host_limit. The daemon
                             sizes it from cache.host_bytes. */
    uint32_t keep_tokens; /* 1: each entry keeps its page's token ids and its parent's key (for
                             events and the snapshot, issue #29): page_size * 4 + 17 bytes per
                             GPU page and host slot more. 0: neither (events carry no tokens). */
} kvp_pcache_config_t;

/* Why a page left the key table (the index of kvp_pcache_stats_t.evictions). */
typedef enum {
    KVP_EVICT_PRESSURE = 0, /* an allocation needed the page */
    KVP_EVICT_FLUSH = 1,    /* kvp_pcache_flush */
    KVP_EVICT_REWRITE = 2,  /* a truncate made it partial again (its content will change) */
    KVP_EVICT_REASONS = 3
} kvp_evict_reason_t;

/* Upper bounds (ms, inclusive) of the residence histogram: how long a cached page stayed in
 * its eviction list before an allocation evicted it (KVP_EVICT_PRESSURE only: what sizes the
 * cache; a flush is not counted); a last bucket counts the rest. */
#define KVP_PCACHE_RESIDENCE_BUCKETS 10
extern const uint64_t kvp_pcache_residence_le_ms[KVP_PCACHE_RESIDENCE_BUCKETS];

typedef struct {
    uint32_t indexed_pages; /* findable GPU pages (held, cached, demoting or restoring) */
    uint32_t cached_pages;  /* findable with refcount 0: in an eviction list */
    uint32_t pinned_pages;  /* pages held by at least one pin */
    uint32_t pins;
    uint64_t query_tokens, hit_tokens; /* lookups and reuse: tokens asked for / found */
    uint64_t evictions[KVP_EVICT_REASONS];
    uint64_t residence[KVP_PCACHE_RESIDENCE_BUCKETS + 1]; /* histogram counts (not cumulative) */
    uint64_t residence_sum_ms;
    uint64_t bytes; /* memory of the cache's own tables (fixed at create) */
    /* the host tier: hit_tokens above are the GPU tier's */
    uint32_t host_pages;        /* entries kept in host slots (not counted in indexed_pages) */
    uint32_t host_slots_usable; /* the limit (kvp_pcache_set_host_limit, <= host_slots) */
    uint32_t host_free;         /* usable slots free */
    uint32_t host_busy;         /* slots a move in flight writes (demotion) or reads (restore) */
    uint32_t demoting;          /* GPU pages of demotions in flight, not cancelled */
    uint32_t restoring;         /* GPU pages whose restore has not ended */
    uint64_t demotions;         /* entries moved to the host tier (kvp_pcache_demote_end) */
    uint64_t promotions;        /* entries moved back to a GPU page (restores started) */
    uint64_t host_evictions;    /* host entries dropped for room or by a lower limit (final) */
    uint64_t host_hit_tokens;   /* found tokens beyond the GPU tier's leading pages */
} kvp_pcache_stats_t;

typedef struct {
    uint32_t indexed_pages, cached_pages;
    uint64_t query_tokens, hit_tokens;
    uint32_t host_pages;
    uint64_t host_hit_tokens;
} kvp_pcache_scope_stats_t;

/* Creates the cache over t (and t's allocator), every page unkeyed. Returns 0, KVP_EINVAL
 * (NULL, zero sizes, t already has a cache) or KVP_ENOMEM. */
int kvp_pcache_create(kvp_seqtab_t *t, const kvp_pcache_config_t *cfg, kvp_pcache_t **out);

/* Drops every pin and every cached page (back to the free stack) and the host tier's entries,
 * detaches from the table and frees the cache. Sequences keep their pages; their keys are
 * forgotten. Moves still in flight (the daemon ends its copies first): a restore's pin goes and
 * its page keeps no key, a demoting page is freed. NULL: no-op. */
void kvp_pcache_destroy(kvp_pcache_t *c);

/* The cache attached to t, or NULL. */
kvp_pcache_t *kvp_seqtab_pcache(const kvp_seqtab_t *t);

/* Advances the cache's clock (ms; never goes back). The planner and the calls below that take
 * now_ms do it themselves. */
void kvp_pcache_set_now(kvp_pcache_t *c, uint64_t now_ms);

/* ---- finding ------------------------------------------------------------------------------ */

/* How many leading full pages of tokens[0..num_tokens) are findable in scope, the chain
 * starting from root (kvp_pagekey_root of the salt). No side effect on any page; adds to the
 * query/hit counters (of the scope too) when count_stats. Returns pages (tokens = pages *
 * page_size). A bad scope returns 0. */
uint32_t kvp_pcache_lookup(kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t root,
                           const int32_t *tokens, uint64_t num_tokens, int count_stats);

/* kvp_pcache_lookup over both tiers: returns the leading pages findable in either tier (on the
 * GPU: indexed pages, demoting and restoring ones included; in the host tier: entries in usable
 * slots), *gpu_pages (when not NULL) the leading pages of those that are on the GPU (gpu <=
 * returned). With count_stats adds the query tokens once and the hit tokens per tier
 * (hit_tokens: the GPU pages, host_hit_tokens: the rest; the scope's too). No other side
 * effect. A bad scope returns 0 (and *gpu_pages 0). */
uint32_t kvp_pcache_lookup_tiers(kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t root,
                                 const int32_t *tokens, uint64_t num_tokens, int count_stats,
                                 uint32_t *gpu_pages);

/* The indexed GPU page holding (scope, key) (demoting and restoring ones too), or UINT32_MAX
 * (also when the entry lives in the host tier: it is not a page to hand out). */
uint32_t kvp_pcache_find(const kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t key);

/* Where the entry (scope, key) lives, in any medium, or kvp_loc_none(). */
kvp_loc_t kvp_pcache_locate(const kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t key);

/* ---- publishing --------------------------------------------------------------------------- */

/* A page as it was when a commit was asked for: published later only if it still holds the
 * same content (its generation changes whenever it is keyed anew or loses its key). */
typedef struct {
    uint32_t page;
    uint32_t gen;
} kvp_pcache_ref_t;

/* The sequence's keyed pages not handed out before, oldest first: writes up to max of them to
 * out and returns how many (call again while it returns max). They are marked handed out: a
 * second call does not return them again (a truncate below them hands them out anew once
 * re-keyed). 0 for a sequence without a chain. */
uint32_t kvp_pcache_take_unpublished(kvp_pcache_t *c, kvp_seq_t *s, kvp_pcache_ref_t *out,
                                     uint32_t max);

/* The pages a writer's plan filled, for that writer to publish once its copy completed (the
 * daemon-run Append: issue #26 defect 2): the keyed, unindexed pages of s from page index
 * from_page (kvp_plan_t.publish_from) to its last keyed page, as refs (page, generation), at most
 * max. Taken right after the plan, they name exactly what the writer wrote: a sequence that
 * grows, is released or whose id is reused while the copy runs changes pages or generations,
 * never these refs. Marks them handed out unless earlier pages still wait for a Commit (which
 * then takes these too; publish skips them while the writer's pins hold them). */
uint32_t kvp_pcache_take_written(kvp_pcache_t *c, kvp_seq_t *s, uint32_t from_page,
                                 kvp_pcache_ref_t *out, uint32_t max);

/* Makes the pages findable: each ref whose page still has that generation, is keyed, held
 * (refcount >= 1), not pinned by the allocator (no daemon copy still writes or reads it) and
 * not indexed goes into the key table unless its (scope, key) is already there on a GPU page.
 * An entry of that (scope, key) in the host tier is replaced: it leaves the table and its slot
 * is free again. Returns how many became findable. */
uint32_t kvp_pcache_publish(kvp_pcache_t *c, const kvp_pcache_ref_t *refs, uint32_t n);

/* kvp_pcache_take_unpublished + kvp_pcache_publish of everything s keyed (the daemon's own
 * Append, once its copy completed). Returns pages published. */
uint32_t kvp_pcache_publish_seq(kvp_pcache_t *c, kvp_seq_t *s);

/* ---- retention, pins, flush --------------------------------------------------------------- */

/* Sets the retention of s's pages from now on (0..KVP_PCACHE_MAX_PRIORITY; retention_ms 0: no
 * end). A page takes the highest priority of the sequences that held it. KVP_EINVAL for a
 * priority above the maximum or a sequence without a chain. */
int kvp_pcache_set_retention(kvp_pcache_t *c, kvp_seq_t *s, uint32_t priority,
                             uint32_t retention_ms);

/* A namespace's quota of pinned pages: the sum of the pages of its pins (a page pinned twice
 * counts twice). 0 forbids pins; UINT64_MAX (every namespace's until set) is no limit.
 * Lowering it below current use only refuses new pins. KVP_EINVAL for a bad ns. */
int kvp_pcache_set_pin_quota(kvp_pcache_t *c, uint32_t ns, uint64_t max_pinned_pages);

/* Pins the findable prefix of tokens (scope, root) for namespace ns until now_ms + ttl_ms:
 * a reference on each page (GPU pages only, restoring ones included; a demoting page's
 * demotion is cancelled). Its pages count in the namespace's pinned_pages (kvp_ns_stats_t),
 * against its pinned-page quota and its page quota (max_page_refs covers the page references
 * of its sequences and of its pins: issue #26 defect 6). Returns 0 and *pin_id (never 0),
 * *pages (>= 1); KVP_ENOENT (no page of it is findable), KVP_ELIMIT (either quota, or
 * max_pins), KVP_ENOMEM, KVP_EINVAL (bad ns or scope). Nothing changes on error. */
int kvp_pcache_pin(kvp_pcache_t *c, uint32_t ns, uint32_t scope, kvp_pagekey_t root,
                   const int32_t *tokens, uint64_t num_tokens, uint64_t now_ms, uint64_t ttl_ms,
                   uint64_t *pin_id, uint32_t *pages);

/* Drops a pin of namespace ns. Returns the pages it held (>= 1) or KVP_ENOENT (no such pin
 * of ns). */
int kvp_pcache_unpin(kvp_pcache_t *c, uint32_t ns, uint64_t pin_id);

/* Drops every pin of namespace ns (it is being released); returns how many. O(max_pins). */
uint32_t kvp_pcache_unpin_ns(kvp_pcache_t *c, uint32_t ns);
/* The latest expiry (ms) of ns's pins, 0 without one. O(max_pins). */
uint64_t kvp_pcache_ns_last_expiry(const kvp_pcache_t *c, uint32_t ns);

/* Drops every pin whose time is up at now_ms; returns how many. Also moves pages whose
 * retention duration ended to the default priority. */
uint32_t kvp_pcache_expire(kvp_pcache_t *c, uint64_t now_ms);

/* The earliest pin expiry (ms), or UINT64_MAX when there is no pin. */
uint64_t kvp_pcache_next_expiry(const kvp_pcache_t *c);

/* Pinned page references of a namespace (its quota use), and its pins. */
uint64_t kvp_pcache_ns_pinned_pages(const kvp_pcache_t *c, uint32_t ns);
uint32_t kvp_pcache_ns_pins(const kvp_pcache_t *c, uint32_t ns);

/* Evicts every cached page of scope (KVP_PCACHE_NO_SCOPE: of every scope), every demoting page
 * of it (its key goes and the page is free at once: the copy in flight only reads it, and its
 * end is discarded) and every entry of it kept in the host tier (its slot is free again). Held,
 * pinned and restoring pages stay, and so do busy slots until their move ends. Returns how many
 * entries went. */
uint32_t kvp_pcache_flush(kvp_pcache_t *c, uint32_t scope);

/* ---- the host tier (issue #28) ------------------------------------------------------------ */

/* Makes host slots [0, min(n, host_slots)) usable (0 at create). Raising frees the new slots
 * (one still busy with a move becomes free when the move ends). Lowering drops the entries kept
 * in slots >= n for good (counted in host_evictions) and takes free ones out of use; a slot >= n
 * busy with a move stops being used when the move ends. O(slots changed). */
void kvp_pcache_set_host_limit(kvp_pcache_t *c, uint32_t n);

/* A copy between a GPU page and a host slot: the page, its generation when the move began
 * (kvp_pcache_ref_t's), the slot. Plain values; the cache keeps the slot busy until the end call
 * that names it. */
typedef struct {
    uint32_t page, gen, slot;
} kvp_pcache_move_t;

/* The watermark path (memcached extstore's storage thread is the model): starts demoting cached
 * GPU pages, in GPU eviction order, while kvp_alloc_num_free(a) + (pages already demoting) <
 * want_free_pages and fewer than max were started: each gets a host slot (the lowest free one,
 * else the host order's head is dropped for good; none: stop). The page leaves its eviction
 * list but stays indexed and findable on the GPU (a link or pin cancels the demotion); it is
 * neither free nor cached until kvp_pcache_demote_end. The slot is busy. Advances the clock to
 * now_ms first (ended retention durations count). Writes out[0..ret) (room for max) and returns
 * ret: the caller copies each page's bytes into its slot, then calls kvp_pcache_demote_end. */
uint32_t kvp_pcache_demote_begin(kvp_pcache_t *c, uint64_t now_ms, uint32_t want_free_pages,
                                 uint32_t max, kvp_pcache_move_t *out);

/* The copies of m[0..n) (from kvp_pcache_demote_begin) ended; ok: the bytes are in the slots.
 * For each: a demotion still untouched (the page still demoting with the same generation into
 * that slot) moves its entry to the slot (indexed there, at the host order's tail with its
 * priority and retention) and the page goes to the free stack; !ok, or a slot the limit retired
 * meanwhile, puts the page back at its eviction list's tail (cached) and frees the slot. A
 * cancelled demotion (the page was linked, pinned, flushed or rewritten meanwhile) only frees
 * the slot: the page is whoever's it is now. A move whose slot is not busy with a demotion of
 * that page (ended already, made up) is ignored. A slot at or above the limit is retired instead
 * of freed. Returns how many entries moved to the host tier. */
uint32_t kvp_pcache_demote_end(kvp_pcache_t *c, const kvp_pcache_move_t *m, uint32_t n, int ok);

/* The restores of m[0..n) (kvp_plan_t.restores) ended; ok: the bytes are in the pages. For
 * each: the page stops RESTORING, the pin the planner took goes (a page no sequence holds any
 * longer becomes cached), the slot is free (or retired above the limit). !ok: the page's content
 * is not there, so its entry leaves the key table (counted as a KVP_EVICT_REWRITE eviction, its
 * generation changes); the sequences holding it keep it as a private page, never published.
 * A move whose slot is not busy with a restore into that page is ignored. */
void kvp_pcache_restore_end(kvp_pcache_t *c, const kvp_pcache_move_t *m, uint32_t n, int ok);

/* 1 while page is RESTORING (a restore into it started and has not ended), else 0. A call that
 * linked such a page waits for that restore before its worker reads the page. */
int kvp_pcache_restoring(const kvp_pcache_t *c, uint32_t page);

/* Pin iteration (kvpoolctl): start with *cursor = 0; returns 0 and the pin's fields, or
 * KVP_ENOENT at the end. */
typedef struct {
    uint64_t pin_id;
    uint32_t ns, scope, pages;
    uint64_t expires_ms;
} kvp_pcache_pin_info_t;
int kvp_pcache_next_pin(const kvp_pcache_t *c, uint32_t *cursor, kvp_pcache_pin_info_t *out);

/* ---- events (issue #29) ------------------------------------------------------------------- */

/* What the key table did, told to an observer as it happens (on the caller's thread, inside
 * the call that did it): an entry became findable in a medium (STORED: published, promoted
 * (GPU), demoted (HOST)) or stopped being findable there (REMOVED: evicted, flushed, rewritten,
 * a failed restore, demoted (GPU), promoted (HOST), dropped from the host tier). A move between
 * media is REMOVED from one then STORED in the other. A flush of every scope
 * (KVP_PCACHE_NO_SCOPE) is one CLEARED followed by STORED for each entry still findable (held,
 * pinned, restoring), instead of a REMOVED per entry. */
typedef enum {
    KVP_PCEV_STORED = 0,
    KVP_PCEV_REMOVED = 1,
    KVP_PCEV_CLEARED = 2
} kvp_pcache_event_kind_t;

typedef struct {
    uint32_t kind;         /* kvp_pcache_event_kind_t */
    uint32_t medium;       /* kvp_medium_t (not CLEARED) */
    uint32_t scope;        /* not CLEARED */
    uint32_t has_parent;   /* STORED, keep_tokens: 0 for the first page of a chain */
    kvp_pagekey_t key;     /* not CLEARED */
    kvp_pagekey_t parent;  /* STORED, keep_tokens, has_parent: the previous page's key */
    const int32_t *tokens; /* STORED: page_size token ids, NULL without keep_tokens; valid
                              during the call only */
} kvp_pcache_event_t;

typedef void (*kvp_pcache_observer_t)(void *ctx, const kvp_pcache_event_t *ev);

/* Sets (fn NULL: removes) the observer. Costs nothing when none is set. kvp_pcache_destroy
 * tells it nothing. */
void kvp_pcache_set_observer(kvp_pcache_t *c, kvp_pcache_observer_t fn, void *ctx);

/* Every findable entry, for the snapshot: start with *cursor = 0; returns 0 and the next entry
 * (GPU pages in page order, then host slots in slot order; demoting and restoring pages are the
 * GPU's), or KVP_ENOENT at the end. The fields are kvp_pcache_event_t's of a STORED event
 * (kind KVP_PCEV_STORED). O(slots) over a whole iteration. */
int kvp_pcache_next_entry(const kvp_pcache_t *c, uint32_t *cursor, kvp_pcache_event_t *out);

/* ---- reading ------------------------------------------------------------------------------ */

void kvp_pcache_stats(const kvp_pcache_t *c, kvp_pcache_stats_t *out);
/* Zeroes a scope's counters before its id is given to another scope: 0, KVP_EBUSY (pages of it
 * are still indexed or keyed, or a sequence's chain still keys pages into it: flush it first and
 * drop what holds them), KVP_EINVAL (bad scope). O(pages + sequences). */
int kvp_pcache_scope_reset(kvp_pcache_t *c, uint32_t scope);
/* KVP_EINVAL for a bad scope. */
int kvp_pcache_scope_stats(const kvp_pcache_t *c, uint32_t scope, kvp_pcache_scope_stats_t *out);

/* A page's cache state, for tests and the audit: bit 0 keyed, bit 1 indexed, bit 2 cached,
 * bit 3 demoting (its copy out to a host slot is in flight), bit 4 restoring (its content is
 * being copied in from a host slot). */
#define KVP_PAGE_KEYED     1u
#define KVP_PAGE_INDEXED   2u
#define KVP_PAGE_CACHED    4u
#define KVP_PAGE_DEMOTING  8u
#define KVP_PAGE_RESTORING 16u
#define KVP_SLOT_BUSY      32u /* a host slot a move in flight writes or reads (no entry) */
unsigned kvp_pcache_page_state(const kvp_pcache_t *c, uint32_t page);
/* The same for any location: a GPU page as above; a host slot is KEYED | INDEXED when an entry
 * lives there, KVP_SLOT_BUSY during a move, else 0 (free or unused, as is a location out of
 * range). */
unsigned kvp_pcache_loc_state(const kvp_pcache_t *c, kvp_loc_t loc);
/* The key and scope of a keyed page (0 and *key, *scope), else KVP_ENOENT. */
int kvp_pcache_page_key(const kvp_pcache_t *c, uint32_t page, kvp_pagekey_t *key, uint32_t *scope);
/* The same for any location. */
int kvp_pcache_loc_key(const kvp_pcache_t *c, kvp_loc_t loc, kvp_pagekey_t *key, uint32_t *scope);

/* The cached pages in eviction order, first to go first: writes up to max page ids, returns
 * how many it wrote. O(cached). For tests. */
uint32_t kvp_pcache_eviction_order(const kvp_pcache_t *c, uint32_t *out, uint32_t max);
/* The entries of one medium in that medium's order (GPU: as above; host: by priority, then
 * demotion order, the order in which host entries are dropped for room): up to max locations,
 * returns how many it wrote. O(entries). For tests. */
uint32_t kvp_pcache_eviction_order_in(const kvp_pcache_t *c, uint32_t medium, kvp_loc_t *out,
                                      uint32_t max);

/* Checks every invariant of the cache and of the table it is attached to (kvp_seqtab_audit
 * first): each indexed page is in the key table exactly once and found through it, no two
 * entries share (scope, key) whatever their media, cached pages are exactly the indexed ones
 * with refcount 0, no allocator pin and no demotion, each in exactly one eviction list exactly
 * once, in its priority's list, referenced pages in none; demoting pages have refcount 0, no
 * allocator pin, are in no list and name a slot busy with their demotion; restoring pages are
 * pinned and name a slot busy with their restore; every usable host slot is exactly one of free
 * (in the free set), an entry (keyed, indexed, in its priority's host list once) or busy (one
 * move in flight), and no slot at or above the limit is free or an entry; refcounts equal
 * sequence references plus pin references; pinned-page counts and namespace quota use add up;
 * every counter (host_pages, host_free, host_busy, demoting, restoring, per scope too) equals
 * its recount; with keep_tokens, an entry's has_parent is 0 or 1 and, when 1, its parent's key
 * and its tokens make its key. Returns 0, KVP_EAUDIT with the first violation in msg, or
 * KVP_ENOMEM. O(pages + host slots). */
int kvp_pcache_audit(const kvp_pcache_t *c, char *msg, unsigned msg_len);

#ifdef __cplusplus
}
#endif
#endif
