package agentscale

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// process is a tokenbroker process started by Run, its output in log.
type process struct {
	cmd     *exec.Cmd
	log     string
	started time.Time
	done    chan error
	// ops is its operations address; port its API port (brokers only).
	ops  string
	port int

	stopOnce sync.Once
}

// startProcess starts bin with args, its environment this process's and
// env, its output to logFile.
func startProcess(bin string, env []string, logFile string, args ...string) (*process, error) {
	out, err := os.Create(logFile)
	if err != nil {
		return nil, err
	}
	defer out.Close()
	p := &process{cmd: exec.Command(bin, args...), log: logFile, done: make(chan error, 1)}
	p.cmd.Stdout, p.cmd.Stderr = out, out
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p.started = time.Now()
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s %s: %w", bin, args[0], err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	return p, nil
}

// stop sends SIGTERM and waits up to 15 s, then kills.
func (p *process) stop() {
	p.stopOnce.Do(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(15 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	})
}

// waitOK polls url until it answers 200, p exits or the timeout passes.
func waitOK(ctx context.Context, url string, p *process, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case err := <-p.done:
			p.done <- err
			return fmt.Errorf("exited before %s answered: %v", url, err)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not OK after %s", url, timeout)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// freePorts returns n distinct ports, free on every address at the time
// of the call: all are held at once, so none is handed out twice.
func freePorts(n int) ([]int, error) {
	var ports []int
	var lns []net.Listener
	defer func() {
		for _, l := range lns {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", ":0")
		if err != nil {
			return nil, err
		}
		lns = append(lns, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// rssSampler reads a process's resident set size from /proc every 50 ms.
type rssSampler struct {
	mu      sync.Mutex
	samples []rssSample
	done    chan struct{}
	once    sync.Once
}

type rssSample struct {
	at time.Time
	// rss is VmRSS, anon its anonymous part (heap, stacks, runtime), the
	// rest file-backed (the binary's pages) and shared memory.
	rss, anon float64
}

func sampleRSS(pid int) *rssSampler {
	s := &rssSampler{done: make(chan struct{})}
	go func() {
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			if x, err := readRSS(pid); err == nil {
				x.at = time.Now()
				s.mu.Lock()
				s.samples = append(s.samples, x)
				s.mu.Unlock()
			}
			select {
			case <-s.done:
				return
			case <-t.C:
			}
		}
	}()
	return s
}

func (s *rssSampler) stop() { s.once.Do(func() { close(s.done) }) }

// rssFigures are the sampler's figures in MB over a span: the highest
// RSS from the first sample to the span's end, and the median RSS and
// anonymous RSS of the samples in the span.
type rssFigures struct {
	peak, median, medianAnon float64
}

func (s *rssSampler) figures(from, to time.Time) rssFigures {
	s.mu.Lock()
	defer s.mu.Unlock()
	var f rssFigures
	var rss, anon []float64
	for _, x := range s.samples {
		if x.at.After(to) {
			break
		}
		f.peak = max(f.peak, x.rss)
		if !x.at.Before(from) {
			rss, anon = append(rss, x.rss), append(anon, x.anon)
		}
	}
	if len(rss) > 0 {
		slices.Sort(rss)
		slices.Sort(anon)
		f.median, f.medianAnon = rss[len(rss)/2], anon[len(anon)/2]
	}
	return f
}

// readRSS reads VmRSS and RssAnon from /proc/pid/status, in MB.
func readRSS(pid int) (rssSample, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return rssSample{}, err
	}
	var x rssSample
	found := 0
	for _, line := range strings.Split(string(data), "\n") {
		for key, dst := range map[string]*float64{"VmRSS:": &x.rss, "RssAnon:": &x.anon} {
			if rest, ok := strings.CutPrefix(line, key); ok {
				f := strings.Fields(rest)
				if len(f) == 0 {
					return x, fmt.Errorf("bad %s line in /proc status", key)
				}
				kb, err := strconv.ParseFloat(f[0], 64)
				if err != nil {
					return x, err
				}
				*dst = kb / 1024
				found++
			}
		}
	}
	if found != 2 {
		return x, errors.New("no VmRSS or RssAnon in /proc status")
	}
	return x, nil
}
