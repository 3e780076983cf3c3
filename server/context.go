package server

import (
	"context"
	"crypto/x509"

	"go.uber.org/zap"

	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/pki"
)

type ctxKey int

const (
	requestInfoKey ctxKey = iota
	peerKey
)

// requestInfo is what the middleware learns about a request, shared between
// the outer middleware (which logs it) and the inner ones (which fill it).
// A request is served by one goroutine, so it needs no lock.
type requestInfo struct {
	id       string
	listener string
	route    string
	identity string
	// workload is the verified workload ("namespace/serviceAccount"), if
	// the request carried a workload token.
	workload string
	log      *zap.Logger
}

// peer is the authenticated caller and the certificate it presented.
type peer struct {
	caller broker.Caller
	cert   *x509.Certificate
	// pod is the workload of a pod certificate: the caller is a workload
	// of the cluster of its CA, or, for the cluster's agent
	// (caller.Agent), the cluster itself.
	pod *pki.PodWorkload
}

func withRequestInfo(ctx context.Context, info *requestInfo) context.Context {
	return context.WithValue(ctx, requestInfoKey, info)
}

func requestInfoFrom(ctx context.Context) *requestInfo {
	info, _ := ctx.Value(requestInfoKey).(*requestInfo)
	return info
}

// requestIDFrom returns the request id, or "" outside the middleware chain.
func requestIDFrom(ctx context.Context) string {
	if info := requestInfoFrom(ctx); info != nil {
		return info.id
	}
	return ""
}

// loggerFrom returns the request's logger (carrying its request id), or a
// no-op logger outside the middleware chain.
func loggerFrom(ctx context.Context) *zap.Logger {
	if info := requestInfoFrom(ctx); info != nil && info.log != nil {
		return info.log
	}
	return zap.NewNop()
}

func withPeer(ctx context.Context, p peer) context.Context {
	return context.WithValue(ctx, peerKey, p)
}

// peerFrom returns the authenticated peer. The authentication middleware
// guarantees one for every API handler.
func peerFrom(ctx context.Context) (peer, bool) {
	p, ok := ctx.Value(peerKey).(peer)
	return p, ok
}

// listenerFrom returns the name of the listener that received the request,
// or "" outside the middleware chain.
func listenerFrom(ctx context.Context) string {
	if info := requestInfoFrom(ctx); info != nil {
		return info.listener
	}
	return ""
}
