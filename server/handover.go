package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"
)

// Shutting down without dropping a request.
//
// On a pod network the Service stops sending new connections to a
// terminating Pod only once its endpoints have been updated, a moment
// after the Pod got SIGTERM: Config.ShutdownDelay keeps the listeners
// open that long, with /readyz answering 503 and keep-alives off, before
// they close.
//
// With the node's network (the chart's hostNetwork), a new Pod and the one
// it replaces share the node's ports: Config.ReusePort opens every
// listener with SO_REUSEPORT, so that both listen at once and the kernel
// spreads new connections over them. The old one then waits, at most
// ShutdownDelay, until another instance answers /readyz on the shared
// operations port, and only then closes its listeners: from that moment
// the successor alone is offered new connections. Run binds the listeners
// only once the broker is ready (run.go), so an instance that answers
// /readyz is also serving the API. A connection that the kernel queued on
// the old socket in its last moment is reset when the socket closes,
// unless the node sets net.ipv4.tcp_migrate_req=1 (Linux 5.14+), which
// hands it to the successor instead.

// InstanceHeader names the instance that answered on the operations
// listener: a random id per process, so that an instance can tell its
// successor's answers from its own on a port they share.
const InstanceHeader = "X-Tokenbroker-Instance"

// handoverPoll is how often a draining instance asks for a successor.
const handoverPoll = 50 * time.Millisecond

func newInstanceID() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return hex.EncodeToString(b)
}

// listenConfig opens listeners, with SO_REUSEPORT if reusePort.
func listenConfig(reusePort bool) net.ListenConfig {
	if !reusePort {
		return net.ListenConfig{}
	}
	return net.ListenConfig{Control: reusePortControl}
}

// drainDelay runs between the start of a shutdown and the closing of the
// listeners: ShutdownDelay, cut short with ReusePort once a successor
// answers on the operations address ops.
func (s *Server) drainDelay(ops net.Addr) {
	if s.cfg.ShutdownDelay <= 0 {
		return
	}
	start := s.cfg.Clock.Now()
	if !s.cfg.ReusePort {
		s.log.Info("draining before closing the listeners", zap.Duration("delay", s.cfg.ShutdownDelay))
		<-s.cfg.Clock.After(s.cfg.ShutdownDelay)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	found := make(chan string, 1)
	go func() {
		if id, err := s.awaitSuccessor(ctx, ops); err == nil {
			found <- id
		}
	}()
	select {
	case id := <-found:
		s.log.Info("a successor serves on the shared ports; closing the listeners",
			zap.String("successor", id), zap.Duration("after", s.cfg.Clock.Since(start)))
	case <-s.cfg.Clock.After(s.cfg.ShutdownDelay):
		s.log.Info("no successor answered on the shared ports; closing the listeners", zap.Duration("after", s.cfg.ShutdownDelay))
	}
}

// awaitSuccessor asks GET /readyz on ops, over a new connection each time
// (each can land on another listener of the port), until another
// instance answers 200, and returns its id.
func (s *Server) awaitSuccessor(ctx context.Context, ops net.Addr) (string, error) {
	addr := loopbackFor(ops)
	client := &http.Client{
		Timeout:   time.Second,
		Transport: &http.Transport{DisableKeepAlives: true, Proxy: nil},
	}
	ticker := time.NewTicker(handoverPoll)
	defer ticker.Stop()
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/readyz", nil)
		if err != nil {
			return "", err
		}
		if resp, err := client.Do(req); err == nil {
			_ = resp.Body.Close()
			if id := resp.Header.Get(InstanceHeader); resp.StatusCode == http.StatusOK && id != "" && id != s.instance {
				return id, nil
			}
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-ticker.C:
		}
	}
}

// loopbackFor is the address to reach a listener at a from the same host:
// a wildcard address is reached on loopback.
func loopbackFor(a net.Addr) string {
	tcp, ok := a.(*net.TCPAddr)
	if !ok {
		return a.String()
	}
	ip := tcp.IP
	switch {
	case ip == nil || ip.Equal(net.IPv4zero):
		ip = net.IPv4(127, 0, 0, 1)
	case ip.Equal(net.IPv6unspecified):
		ip = net.IPv6loopback
	}
	return net.JoinHostPort(ip.String(), strconv.Itoa(tcp.Port))
}
