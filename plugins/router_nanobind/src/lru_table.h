// A bounded map from 64-bit keys to small values, least recently used first out: the session
// table and the prefix index of a pool. Not thread-safe; the pool's mutex guards it.
//
// Flat, because route() does one look-up and one update per prefix block: entries live in one
// vector, linked oldest to newest by index, and an open-addressing index (linear probing, at
// most half full) maps keys to them. A look-up touches two cache lines, an update allocates
// nothing once the table is full, and an entry costs 24-32 bytes plus 8-16 of index: a memory
// cap of about 48 bytes x capacity. (std::unordered_map + std::list took ~90 bytes and ~30%
// longer per prefix decision.)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace laya {

template <class Value>
class LruTable {
public:
    static constexpr std::size_t kMaxCapacity = 0x7fff'ffff;  // entry indices are 32-bit

    explicit LruTable(std::size_t capacity) : capacity_(capacity) { rebuild_index(16); }

    // The value stored for `key`, or nullptr; does not count as a use.
    const Value* find(std::uint64_t key) const {
        std::uint32_t entry = index_[bucket_of(key)];
        return entry == kNone ? nullptr : &entries_[entry].value;
    }

    // Store `key` as the most recently used entry; beyond capacity the least recent one goes.
    // The same outcome as PythonRouter's OrderedDict: set, move to end, pop first if too many.
    void put(std::uint64_t key, const Value& value) {
        std::size_t bucket = bucket_of(key);
        if (index_[bucket] != kNone) {
            entries_[index_[bucket]].value = value;
            make_newest(index_[bucket]);
            return;
        }
        if (size_ == capacity_) {
            pop_oldest();  // never `key`, which is absent
            bucket = bucket_of(key);  // the removal may have shifted the probe sequence
        }
        if (2 * (size_ + 1) > index_.size()) {
            rebuild_index(2 * index_.size());
            bucket = bucket_of(key);
        }
        std::uint32_t entry = new_entry();
        entries_[entry].key = key;
        entries_[entry].value = value;
        index_[bucket] = entry;
        link_newest(entry);
        ++size_;
    }

    // The least recently used entry (the table must not be empty), and its removal.
    const Value& oldest() const { return entries_[oldest_].value; }
    void pop_oldest() {
        std::uint32_t entry = oldest_;
        erase_from_index(bucket_of(entries_[entry].key));
        unlink(entry);
        entries_[entry].newer = free_;  // the free list reuses `newer`
        free_ = entry;
        --size_;
    }

    bool empty() const { return size_ == 0; }
    std::size_t size() const { return size_; }

private:
    static constexpr std::uint32_t kNone = 0xffff'ffff;

    struct Entry {
        std::uint64_t key;
        Value value;
        std::uint32_t older = kNone;
        std::uint32_t newer = kNone;
    };

    // Fibonacci hashing: the top bits of key x 2^64/phi, so small or patterned keys spread too.
    std::size_t home_of(std::uint64_t key) const {
        return static_cast<std::size_t>((key * 0x9e37'79b9'7f4a'7c15ULL) >> shift_);
    }

    // The bucket holding `key`, or the empty bucket where it would go.
    std::size_t bucket_of(std::uint64_t key) const {
        const std::size_t mask = index_.size() - 1;
        std::size_t bucket = home_of(key);
        while (index_[bucket] != kNone && entries_[index_[bucket]].key != key)
            bucket = (bucket + 1) & mask;
        return bucket;
    }

    // Backward-shift deletion: later entries of the probe run move into the hole when their
    // home allows it, so look-ups never need tombstones.
    void erase_from_index(std::size_t hole) {
        const std::size_t mask = index_.size() - 1;
        for (std::size_t next = (hole + 1) & mask; index_[next] != kNone; next = (next + 1) & mask) {
            std::size_t home = home_of(entries_[index_[next]].key);
            if (((next - home) & mask) >= ((next - hole) & mask)) {
                index_[hole] = index_[next];
                hole = next;
            }
        }
        index_[hole] = kNone;
    }

    void rebuild_index(std::size_t num_buckets) {  // a power of two
        index_.assign(num_buckets, kNone);
        shift_ = 64;
        for (std::size_t n = num_buckets; n > 1; n >>= 1)
            --shift_;
        for (std::uint32_t entry = oldest_; entry != kNone; entry = entries_[entry].newer)
            index_[bucket_of(entries_[entry].key)] = entry;
    }

    std::uint32_t new_entry() {
        if (free_ != kNone) {
            std::uint32_t entry = free_;
            free_ = entries_[entry].newer;
            return entry;
        }
        if (entries_.size() == entries_.capacity())  // grow, but never past the capacity
            entries_.reserve(std::min(capacity_, std::max<std::size_t>(16, 2 * entries_.size())));
        entries_.emplace_back();
        return static_cast<std::uint32_t>(entries_.size() - 1);
    }

    void link_newest(std::uint32_t entry) {
        entries_[entry].older = newest_;
        entries_[entry].newer = kNone;
        if (newest_ == kNone)
            oldest_ = entry;
        else
            entries_[newest_].newer = entry;
        newest_ = entry;
    }

    void unlink(std::uint32_t entry) {
        const Entry& e = entries_[entry];
        if (e.older == kNone)
            oldest_ = e.newer;
        else
            entries_[e.older].newer = e.newer;
        if (e.newer == kNone)
            newest_ = e.older;
        else
            entries_[e.newer].older = e.older;
    }

    void make_newest(std::uint32_t entry) {
        if (entry != newest_) {
            unlink(entry);
            link_newest(entry);
        }
    }

    std::vector<Entry> entries_;       // linked oldest -> newest through older/newer
    std::vector<std::uint32_t> index_;  // bucket -> entry, kNone when empty
    std::uint32_t oldest_ = kNone;
    std::uint32_t newest_ = kNone;
    std::uint32_t free_ = kNone;  // entries popped by pop_oldest, for reuse
    std::size_t size_ = 0;
    std::size_t capacity_;
    int shift_ = 64;
};

}  // namespace laya
