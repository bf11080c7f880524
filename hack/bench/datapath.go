package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/loopdev"
)

// The data path measurement: O_DIRECT 1 MiB reads and writes at random
// aligned offsets, at queue depth 1 and 16 (that many threads, each with
// one I/O in flight), on the backing file itself and through loop devices
// bound to it in several configurations. Targets take turns in short
// bursts, round after round, so that drifts hit them alike; each target's
// throughput is its bytes over its own time.
const (
	dataImageSize = 512 << 20
	dataIOSize    = 1 << 20
)

// loopConfig is one way of binding the loop device.
type loopConfig struct {
	name string
	opts loopdev.Options
}

// dataResult is one target's throughput at one queue depth and direction.
type dataResult struct {
	Target string  `json:"target"`
	Op     string  `json:"op"` // "read" or "write"
	Depth  int     `json:"queue_depth"`
	MiBps  float64 `json:"mib_per_s"`
	Ratio  float64 `json:"ratio_to_file"`
}

type dataTarget struct {
	name  string
	path  string
	dev   *loopdev.Device // nil for the file
	f     *os.File        // opened O_DIRECT, read-write
	bytes map[string]int64
	spent map[string]time.Duration
}

func (b *bench) measureDataPath(ctx context.Context, res *results) (err error) {
	img := filepath.Join(b.dir, "data.img")
	if err := fillImage(img, dataImageSize); err != nil {
		return err
	}
	defer os.Remove(img)
	var st unix.Statfs_t
	if err := unix.Statfs(img, &st); err != nil {
		return err
	}
	fsBlock := uint32(st.Bsize)
	configs := []loopConfig{
		{"loop, buffered, the kernel's block size (losetup's defaults)", loopdev.Options{}},
		{"loop, direct I/O, 512 B blocks", loopdev.Options{DirectIO: true, BlockSize: 512}},
		{fmt.Sprintf("loop, direct I/O, %d B blocks (the backing filesystem's)", fsBlock), loopdev.Options{DirectIO: true, BlockSize: fsBlock}},
		{fmt.Sprintf("loop, buffered, %d B blocks", fsBlock), loopdev.Options{BlockSize: fsBlock}},
	}
	targets := []*dataTarget{{name: "backing file, O_DIRECT", path: img}}
	defer func() {
		for _, t := range targets {
			if t.f != nil {
				err = errors.Join(err, t.f.Close())
			}
			if t.dev != nil {
				err = errors.Join(err, t.dev.Detach())
			}
		}
	}()
	for _, c := range configs {
		dev, err := loopdev.Attach(ctx, img, c.opts)
		if err != nil {
			return fmt.Errorf("attach %s: %w", c.name, err)
		}
		name := c.name
		if c.opts.DirectIO && !dev.DirectIO {
			name += " (direct I/O refused: buffered)"
		}
		targets = append(targets, &dataTarget{name: name, path: dev.Path, dev: dev})
	}
	for _, t := range targets {
		if t.f, err = os.OpenFile(t.path, os.O_RDWR|unix.O_DIRECT|unix.O_CLOEXEC, 0); err != nil {
			return err
		}
		t.bytes, t.spent = map[string]int64{}, map[string]time.Duration{}
	}
	// The image through the page cache, to settle it between bursts.
	settle, err := os.OpenFile(img, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer settle.Close()
	burst := time.Duration(float64(time.Second) * b.o.dataSeconds / float64(len(targets)*4*b.o.dataRounds))
	b.logf("data path: %d targets, %d rounds of %v bursts", len(targets), b.o.dataRounds, burst)
	for round := 0; round < b.o.dataRounds; round++ {
		for _, depth := range []int{1, 16} {
			for _, op := range []string{"read", "write"} {
				for _, t := range targets {
					if err := ctx.Err(); err != nil {
						return err
					}
					n, d, err := ioBurst(t.f, op, depth, burst)
					if err != nil {
						return fmt.Errorf("%s %s: %w", t.name, op, err)
					}
					k := fmt.Sprintf("%s/%d", op, depth)
					t.bytes[k] += n
					t.spent[k] += d
					if err := settleImage(settle); err != nil {
						return err
					}
				}
			}
		}
	}
	for _, depth := range []int{1, 16} {
		for _, op := range []string{"read", "write"} {
			k := fmt.Sprintf("%s/%d", op, depth)
			base := mibps(targets[0].bytes[k], targets[0].spent[k])
			for _, t := range targets {
				r := dataResult{Target: t.name, Op: op, Depth: depth, MiBps: mibps(t.bytes[k], t.spent[k])}
				if base > 0 {
					r.Ratio = r.MiBps / base
				}
				res.dataPath = append(res.dataPath, r)
			}
		}
	}
	return nil
}

// settleImage writes back and drops the image's cached pages, outside
// the timed bursts. A buffered loop device leaves dirty pages in the
// image's page cache; their writeback would otherwise fall into the next
// targets' bursts (the direct I/O loop devices come right after one) and
// an O_DIRECT write to the file must first flush them. Every burst then
// starts from the same state: nothing dirty, nothing cached.
func settleImage(f *os.File) error {
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		return fmt.Errorf("fdatasync %s: %w", f.Name(), err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		return fmt.Errorf("fadvise %s: %w", f.Name(), err)
	}
	return nil
}

func mibps(n int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / (1 << 20) / d.Seconds()
}

// fillImage writes size bytes of random data, so that reads hit real
// blocks (a hole or an unwritten extent reads as zeros without I/O).
func fillImage(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	buf := make([]byte, dataIOSize)
	for off := int64(0); off < size; off += dataIOSize {
		fillRandom(buf)
		if _, err := f.Write(buf); err != nil {
			f.Close()
			return err
		}
	}
	return errors.Join(f.Sync(), f.Close())
}

func fillRandom(buf []byte) {
	for i := 0; i+8 <= len(buf); i += 8 {
		v := rand.Uint64()
		for j := range 8 {
			buf[i+j] = byte(v >> (8 * j))
		}
	}
}

// ioBurst does O_DIRECT 1 MiB I/Os at random aligned offsets with depth
// threads for about d; it returns the bytes moved and the time taken.
func ioBurst(f *os.File, op string, depth int, d time.Duration) (int64, time.Duration, error) {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		total int64
		errs  []error
	)
	start := time.Now()
	deadline := start.Add(d)
	for range depth {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread() // one I/O in flight per thread
			buf, err := unix.Mmap(-1, 0, dataIOSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
			if err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
				return
			}
			defer unix.Munmap(buf)
			fillRandom(buf)
			var n int64
			for time.Now().Before(deadline) {
				off := rand.Int64N(dataImageSize/dataIOSize) * dataIOSize
				var k int
				if op == "read" {
					k, err = f.ReadAt(buf, off)
				} else {
					k, err = f.WriteAt(buf, off)
				}
				if err != nil && !errors.Is(err, io.EOF) {
					break
				}
				n += int64(k)
			}
			mu.Lock()
			total += n
			if err != nil && !errors.Is(err, io.EOF) {
				errs = append(errs, err)
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	return total, time.Since(start), errors.Join(errs...)
}
