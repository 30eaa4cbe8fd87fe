#include "router.h"

#include <functional>
#include <utility>

namespace laya {

namespace {

std::size_t hash_of(std::string_view text) { return std::hash<std::string_view>{}(text); }

std::string quoted(std::string_view name) { return "'" + std::string(name) + "'"; }

std::invalid_argument bad(const std::string& message) { return std::invalid_argument(message); }

void check_threshold(std::int64_t imbalance_threshold) {
    if (imbalance_threshold < 0)
        throw bad("imbalance_threshold must be >= 0, got " + std::to_string(imbalance_threshold));
}

}  // namespace

UnknownReplica::UnknownReplica(std::int64_t replica)
    : std::out_of_range("unknown replica " + std::to_string(replica)), replica(replica) {}

// Checked in PythonRouter's order throughout, so the same bad call raises the same error.
Router::Router(std::int64_t session_capacity, std::optional<double> session_ttl_s,
               std::int64_t prefix_capacity, std::int64_t imbalance_threshold)
    : limits_{static_cast<std::size_t>(session_capacity), session_ttl_s,
              static_cast<std::size_t>(prefix_capacity)},
      imbalance_threshold_(imbalance_threshold) {
    constexpr auto kMaxCapacity = static_cast<std::int64_t>(LruTable<int>::kMaxCapacity);
    if (session_capacity < 1 || prefix_capacity < 1 || session_capacity > kMaxCapacity ||
        prefix_capacity > kMaxCapacity)
        throw bad("session_capacity and prefix_capacity must be in [1, 2**31)");
    if (session_ttl_s && !(*session_ttl_s > 0))
        throw bad("session_ttl_s must be > 0 or None, got " + std::to_string(*session_ttl_s));
    check_threshold(imbalance_threshold);
}

// --- tables ------------------------------------------------------------------------------------

void Router::add_replica(std::string_view model, std::int64_t replica, std::int64_t weight) {
    if (replica < 0)
        throw bad("replica ids are >= 0, got " + std::to_string(replica));
    if (weight < 1)
        throw bad("weight must be >= 1, got " + std::to_string(weight));
    std::lock_guard<std::mutex> admin(admin_mutex_);
    ReplicaShard& shard = replica_shard(replica);
    {
        std::lock_guard<std::mutex> lock(shard.mutex);
        if (shard.replicas.count(replica) != 0)
            throw bad("replica " + std::to_string(replica) + " already exists");
    }
    const Name* name = find_name(model);
    if (name && name->is_alias)
        throw bad(quoted(model) + " is an alias of " + quoted(name->pool->model) + ", not a model");
    Pool& pool = name ? *name->pool : create_pool(model);
    auto entry = std::make_unique<Replica>(replica, weight, &pool);
    {
        // Findable by release() before route() can choose it.
        std::lock_guard<std::mutex> lock(shard.mutex);
        shard.replicas.emplace(replica, entry.get());
    }
    pool.add(std::move(entry));
}

void Router::remove_replica(std::int64_t replica) {
    std::lock_guard<std::mutex> admin(admin_mutex_);
    ReplicaShard& shard = replica_shard(replica);
    Replica* entry = nullptr;
    {
        std::lock_guard<std::mutex> lock(shard.mutex);
        entry = &replica_at(shard, replica);
    }
    // Out of the pool first (no new requests), then out of the shard (releases of requests in
    // flight work until then), then freed: a release holding the shard lock has finished.
    std::unique_ptr<Replica> removed = entry->pool->remove(entry);
    std::lock_guard<std::mutex> lock(shard.mutex);
    shard.replicas.erase(replica);
}

void Router::set_state(std::int64_t replica, int state) {
    std::lock_guard<std::mutex> admin(admin_mutex_);
    ReplicaShard& shard = replica_shard(replica);
    std::lock_guard<std::mutex> lock(shard.mutex);
    Replica& entry = replica_at(shard, replica);  // unknown id before bad state, as in Python
    if (state < 0 || state > static_cast<int>(ReplicaState::Down))
        throw bad(std::to_string(state) + " is not a valid ReplicaState");
    entry.state.store(state, std::memory_order_relaxed);
}

void Router::add_alias(std::string_view alias, std::string_view model) {
    std::lock_guard<std::mutex> admin(admin_mutex_);
    if (alias == model)
        throw bad("cannot alias " + quoted(alias) + " to itself");
    if (const Name* existing = find_name(alias)) {
        if (existing->is_alias)
            throw bad(quoted(alias) + " is already an alias of " + quoted(existing->pool->model));
        throw bad(quoted(alias) + " is a model name, it cannot become an alias");
    }
    const Name* target = find_name(model);
    if (target && target->is_alias)
        throw bad(quoted(model) + " is an alias; alias " + quoted(target->pool->model) +
                  " instead");
    Pool& pool = target ? *target->pool : create_pool(model);
    std::size_t hash = hash_of(alias);
    NameShard& shard = shards_->names[hash % kNumShards];
    std::unique_lock<std::shared_mutex> lock(shard.mutex);
    shard.names.emplace(hash, Name{std::string(alias), &pool, true});
}

void Router::set_policy(std::string_view model, std::string_view policy,
                        std::optional<std::int64_t> imbalance_threshold) {
    std::optional<Policy> chosen = policy_named(policy);
    if (!chosen)
        throw bad("unknown routing policy " + quoted(policy) +
                  "; choose one of ('least_outstanding', 'round_robin', 'session', 'prefix')");
    if (imbalance_threshold)
        check_threshold(*imbalance_threshold);
    std::lock_guard<std::mutex> admin(admin_mutex_);
    const Name* name = find_name(model);
    Pool& pool = name ? *name->pool : create_pool(model);
    pool.set_policy(*chosen, imbalance_threshold.value_or(imbalance_threshold_));
}

// The caller holds admin_mutex_, so no other thread adds the same name meanwhile.
Pool& Router::create_pool(std::string_view model) {
    pools_.push_back(std::make_unique<Pool>(std::string(model), limits_, imbalance_threshold_));
    Pool& pool = *pools_.back();
    std::size_t hash = hash_of(model);
    NameShard& shard = shards_->names[hash % kNumShards];
    std::unique_lock<std::shared_mutex> lock(shard.mutex);
    shard.names.emplace(hash, Name{std::string(model), &pool, false});
    return pool;
}

// Names are never erased or changed and multimap nodes never move, so the entry stays valid
// after the shard lock is dropped.
const Router::Name* Router::find_name(std::string_view name) const {
    std::size_t hash = hash_of(name);
    const NameShard& shard = shards_->names[hash % kNumShards];
    std::shared_lock<std::shared_mutex> lock(shard.mutex);
    auto [first, last] = shard.names.equal_range(hash);
    for (; first != last; ++first) {
        if (first->second.text == name)
            return &first->second;
    }
    return nullptr;
}

// --- requests ----------------------------------------------------------------------------------

std::int64_t Router::route(std::string_view model, std::optional<std::string_view> session,
                           const std::vector<std::uint64_t>& prefix) {
    const Name* name = find_name(model);
    if (name == nullptr)
        throw NoRoute("no model named " + quoted(model));
    std::optional<std::uint64_t> session_key;
    if (session)
        session_key = hash_of(*session);  // hashed outside the pool's mutex
    return name->pool->route(model, session_key, prefix);
}

void Router::release(std::int64_t replica) {
    ReplicaShard& shard = replica_shard(replica);
    std::lock_guard<std::mutex> lock(shard.mutex);
    // Every decrement holds this lock, and route() only increments, so the check stays true.
    std::atomic<std::int64_t>& count = replica_at(shard, replica).num_outstanding;
    if (count.load(std::memory_order_relaxed) == 0)
        throw bad("replica " + std::to_string(replica) + " has no outstanding request to release");
    count.fetch_sub(1, std::memory_order_relaxed);
}

std::int64_t Router::outstanding(std::int64_t replica) const {
    ReplicaShard& shard = replica_shard(replica);
    std::lock_guard<std::mutex> lock(shard.mutex);
    return replica_at(shard, replica).num_outstanding.load(std::memory_order_relaxed);
}

// The caller holds the shard's mutex.
Replica& Router::replica_at(const ReplicaShard& shard, std::int64_t replica) const {
    auto found = shard.replicas.find(replica);
    if (found == shard.replicas.end())
        throw UnknownReplica(replica);
    return *found->second;
}

Router::ReplicaShard& Router::replica_shard(std::int64_t replica) const {
    return shards_->replicas[static_cast<std::uint64_t>(replica) % kNumShards];
}

}  // namespace laya
