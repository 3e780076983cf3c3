package integration

import (
	"io"
	"net"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// cutProxy is a TCP proxy on 127.0.0.1 to target that the test can cut:
// every connection through it closed and new ones refused (its listener
// closed), as a broken network or an API server gone away looks to a
// client; mend listens again on the same address.
type cutProxy struct {
	target, addr string

	mu    sync.Mutex
	ln    net.Listener
	conns map[net.Conn]struct{}
}

func startCutProxy(t *testing.T, target string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &cutProxy{target: target, addr: ln.Addr().String(), ln: ln, conns: map[net.Conn]struct{}{}}
	go p.serve(ln)
	t.Cleanup(p.cut)
	return p
}

func (p *cutProxy) serve(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go p.pipe(c)
	}
}

// track keeps c to be closed at a cut; false if the proxy is cut.
func (p *cutProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln == nil {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *cutProxy) untrack(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
		_ = c.Close()
	}
}

func (p *cutProxy) pipe(c net.Conn) {
	if !p.track(c) {
		_ = c.Close()
		return
	}
	u, err := net.Dial("tcp", p.target)
	if err != nil || !p.track(u) {
		if u != nil {
			_ = u.Close()
		}
		p.untrack(c)
		return
	}
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(u, c)
		close(done)
	}()
	_, _ = io.Copy(c, u)
	p.untrack(c, u)
	<-done
}

// cut closes every connection and refuses new ones until mend.
func (p *cutProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln == nil {
		return
	}
	_ = p.ln.Close()
	p.ln = nil
	for c := range p.conns {
		_ = c.Close()
		delete(p.conns, c)
	}
}

// mend accepts connections again, on the same address.
func (p *cutProxy) mend(t *testing.T) {
	t.Helper()
	ln, err := net.Listen("tcp", p.addr)
	require.NoError(t, err)
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	go p.serve(ln)
}
