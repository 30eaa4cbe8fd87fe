#include "pool.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace laya {

std::optional<Policy> policy_named(std::string_view name) {
    if (name == "least_outstanding")
        return Policy::LeastOutstanding;
    if (name == "round_robin")
        return Policy::RoundRobin;
    if (name == "session")
        return Policy::Session;
    if (name == "prefix")
        return Policy::Prefix;
    return std::nullopt;
}

Pool::Pool(std::string model, const TableLimits& limits, std::int64_t imbalance_threshold)
    : model(std::move(model)),
      imbalance_threshold_(imbalance_threshold),
      session_ttl_s_(limits.session_ttl_s),
      sessions_(limits.session_capacity),
      prefixes_(limits.prefix_capacity) {}

void Pool::add(std::unique_ptr<Replica> replica) {
    std::lock_guard<std::mutex> lock(mutex_);
    replicas_.push_back(std::move(replica));
}

std::unique_ptr<Replica> Pool::remove(const Replica* replica) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto position = std::find_if(replicas_.begin(), replicas_.end(),
                                 [replica](const auto& entry) { return entry.get() == replica; });
    auto index = static_cast<std::size_t>(position - replicas_.begin());
    std::unique_ptr<Replica> removed = std::move(*position);
    replicas_.erase(position);
    // Keep the cursor on the same next replica: everything after `index` moved left by one.
    if (index < cursor_)
        --cursor_;
    if (cursor_ >= replicas_.size())
        cursor_ = 0;
    return removed;
}

void Pool::set_policy(Policy policy, std::int64_t imbalance_threshold) {
    std::lock_guard<std::mutex> lock(mutex_);
    policy_ = policy;
    imbalance_threshold_ = imbalance_threshold;
}

std::int64_t Pool::route(std::string_view name, std::optional<std::uint64_t> session_key,
                         const std::vector<std::uint64_t>& prefix) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::optional<std::size_t> least = least_outstanding();
    if (!least)
        throw NoRoute("model '" + std::string(name) + "' has no replica up");
    Replica* chosen = nullptr;
    switch (policy_) {
        case Policy::RoundRobin:
            chosen = &smooth_weighted();
            break;
        case Policy::Session:
            chosen = session_key ? &by_session(*least, *session_key) : &take(*least);
            break;
        case Policy::Prefix:
            chosen = &by_prefix(*least, prefix);
            break;
        case Policy::LeastOutstanding:
            chosen = &take(*least);
            break;
    }
    chosen->num_outstanding.fetch_add(1, std::memory_order_relaxed);
    return chosen->id;
}

std::optional<std::size_t> Pool::least_outstanding() const {
    const std::size_t num_replicas = replicas_.size();
    // Scan once around the pool from the cursor; strict `<` keeps the first of equal loads,
    // which is what makes ties go round robin.
    std::optional<std::size_t> best;
    std::int64_t best_load = 0;
    for (std::size_t offset = 0; offset < num_replicas; ++offset) {
        std::size_t index = (cursor_ + offset) % num_replicas;
        const Replica& candidate = *replicas_[index];
        if (!candidate.is_up())
            continue;
        std::int64_t load = candidate.num_outstanding.load(std::memory_order_relaxed);
        if (!best || load < best_load) {
            best = index;
            best_load = load;
        }
    }
    return best;
}

Replica& Pool::take(std::size_t index) {
    cursor_ = (index + 1) % replicas_.size();
    return *replicas_[index];
}

Replica& Pool::smooth_weighted() {
    Replica* best = nullptr;
    std::int64_t total = 0;
    for (const auto& candidate : replicas_) {
        if (!candidate->is_up())
            continue;
        candidate->current_weight += candidate->weight;
        total += candidate->weight;
        if (best == nullptr || candidate->current_weight > best->current_weight)
            best = candidate.get();
    }
    best->current_weight -= total;  // route() checked that a replica is up
    return *best;
}

Replica& Pool::by_session(std::size_t least, std::uint64_t session_key) {
    double now = 0;
    if (session_ttl_s_) {
        // Read under the mutex, so entries are inserted in time order and the oldest is first.
        auto since_epoch = std::chrono::steady_clock::now().time_since_epoch();
        now = std::chrono::duration<double>(since_epoch).count();
    }
    Replica* chosen = nullptr;
    const Session* known = sessions_.find(session_key);
    if (known && (!session_ttl_s_ || now - known->last_used_s <= *session_ttl_s_))
        chosen = up_member(known->replica);
    if (chosen == nullptr)
        chosen = &take(least);
    while (session_ttl_s_ && !sessions_.empty() &&
           now - sessions_.oldest().last_used_s > *session_ttl_s_)
        sessions_.pop_oldest();
    sessions_.put(session_key, Session{chosen->id, now});
    return *chosen;
}

Replica& Pool::by_prefix(std::size_t least, const std::vector<std::uint64_t>& prefix) {
    Replica* holder = nullptr;
    for (auto block_hash = prefix.rbegin(); block_hash != prefix.rend() && !holder; ++block_hash) {
        if (const std::int64_t* known = prefixes_.find(*block_hash))
            holder = up_member(*known);
    }
    std::int64_t least_loaded = replicas_[least]->num_outstanding.load(std::memory_order_relaxed);
    Replica* chosen = nullptr;
    if (holder &&
        holder->num_outstanding.load(std::memory_order_relaxed) - least_loaded <=
            imbalance_threshold_)
        chosen = holder;
    else
        chosen = &take(least);
    for (std::uint64_t block_hash : prefix)
        prefixes_.put(block_hash, chosen->id);
    return *chosen;
}

// A table entry counts only while its replica is still an UP replica of this pool. Pools hold a
// handful of replicas, so a scan beats a second hash map.
Replica* Pool::up_member(std::int64_t replica) const {
    for (const auto& candidate : replicas_) {
        if (candidate->id == replica)
            return candidate->is_up() ? candidate.get() : nullptr;
    }
    return nullptr;
}

}  // namespace laya
